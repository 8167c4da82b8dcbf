"""Make megatron-core 0.16 run on CPU-only machines. The only place that knows how.

megatron-core assumes CUDA in a few well-known spots; on a machine without a GPU this module
patches exactly those, once, and nothing is done at all where CUDA is available:

* `torch.cuda.current_device()` is called for buffer placement (RoPE, SP gathers, p2p,
  dist-checkpointing) -> answers "cpu"; `synchronize`/`empty_cache` become no-ops.
* The model-parallel RNG tracker keeps CUDA generator states -> `CpuRNGStatesTracker`
  keeps CPU generator states instead, so dropout forks and activation recompute replay the
  same random streams as on GPU.
* A few TransformerConfig flags select fused CUDA kernels or CUDA-side init
  (`transformer_config_overrides`).
* A few entry points create tensors with a literal `device="cuda"` (the pipeline
  schedules' token counters, dist-checkpointing exchanges): they run under
  `CudaToCpuMode`, which rewrites that argument (and makes `.cuda()` a no-op: tied
  embeddings under PP). Only those entry points, so the
  per-op cost of a function mode stays out of everything else.
* One intra-op thread per rank: with several ranks on few cores, oversubscribed OpenMP
  threads make tiny models 5-20x slower.

Everything else in megatron-core used by this project runs unmodified on CPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Patch megatron-core for CPU if (and only if) no GPU is present. Idempotent."""
    global _APPLIED
    if _APPLIED or not needed():
        return
    from megatron.core.tensor_parallel import random as mpu_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    # The "device generator" of a CPU run is the CPU generator.
    mpu_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.set_num_threads(1)
    _run_entry_points_on_cpu()
    _APPLIED = True


def _is_cuda(device) -> bool:
    return (device == "cuda" or (isinstance(device, str) and device.startswith("cuda:"))
            or (isinstance(device, torch.device) and device.type == "cuda"))


class CudaToCpuMode(TorchFunctionMode):
    """Redirect `device="cuda"` arguments of torch calls to the CPU; `.cuda()` is a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _on_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    return wrapper


def _run_entry_points_on_cpu() -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules

    for module, names in (
        (schedules, ("forward_backward_no_pipelining",
                     "forward_backward_pipelining_without_interleaving",
                     "forward_backward_pipelining_with_interleaving")),
        (dist_checkpointing, ("save", "load")),
        # Tied embeddings under PP: the last stage's copy is synced with `.data.cuda()`.
        (LanguageModule, ("setup_embeddings_and_output_layer",)),
    ):
        for name in names:
            setattr(module, name, _on_cpu(getattr(module, name)))


class CpuRNGStatesTracker:
    """megatron's `CudaRNGStatesTracker` contract, over CPU generator states."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name!r} / seed {seed} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def transformer_config_overrides() -> dict:
    """TransformerConfig flags that must be off on CPU (fused CUDA kernels, CUDA-side init)."""
    if not needed():
        return {}
    return dict(use_cpu_initialization=True, masked_softmax_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False,
                apply_rope_fusion=False, persist_layer_norm=False)


def model_parallel_seed(seed: int) -> None:
    """CPU counterpart of megatron's `model_parallel_cuda_manual_seed` (same seed offsets)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mpu_random

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    torch.manual_seed(seed)
    tracker = CpuRNGStatesTracker()
    tracker.add(mpu_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mpu_random._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * ep_rank + tp_rank)
    mpu_random._CUDA_RNG_STATE_TRACKER = tracker
    mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
