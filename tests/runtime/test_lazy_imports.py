"""What megatron-core and DeepSpeed import but a run may not use is loaded at first use:
their compile decorators compile at a function's first call, and wandb's code runs at the
first use of one of its attributes."""

import subprocess
import sys

from megatron_stem.runtime import lazy_imports  # before megatron-core: its import installs the hook


def test_the_decorator_runs_once_at_the_first_call():
    applied = []

    def decorator(fn):
        applied.append(fn)
        return lambda x: fn(x) + 1

    @lazy_imports.lazy(decorator)
    def double(x):
        return 2 * x

    assert applied == [] and double.__name__ == "double"
    assert double(3) == 7 and double(4) == 9
    assert len(applied) == 1


def test_megatrons_fuser_is_the_lazy_torch_compile():
    import megatron.core.jit

    assert getattr(megatron.core.jit.jit_fuser(lambda x: x), "lazily_decorated", False)
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
    assert getattr(bias_swiglu, "lazily_decorated", False)


def test_deepspeeds_muon_kernels_are_compiled_lazily():
    """ZeRO's reduction imports DeepSpeed's Muon whatever the optimizer."""
    from deepspeed.runtime.zero.muon import original_muon

    assert getattr(original_muon.zeropower_via_newtonschulz5, "lazily_decorated", False)


def test_a_bare_torch_compile_in_a_listed_module_compiles_at_the_first_call(tmp_path,
                                                                        monkeypatch):
    """megatron-core 0.19's MoE router decorates with a bare `@torch.compile` as its module
    runs; both spellings are lazy there, and `torch.compile` is itself again afterwards."""
    import importlib

    import torch

    (tmp_path / "compiles_at_import.py").write_text(
        "import torch\n"
        "@torch.compile\n"
        "def bare(x):\n    return x + 1\n"
        "@torch.compile(dynamic=False)\n"
        "def called(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lazy_imports, "LAZY_TORCH_COMPILE", ("compiles_at_import",))
    compile_ = torch.compile
    module = importlib.import_module("compiles_at_import")
    assert torch.compile is compile_
    assert getattr(module.bare, "lazily_decorated", False)
    assert getattr(module.called, "lazily_decorated", False)


def imports(code: str) -> str:
    """The last line `code` prints, run in a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split("\n")[-2]


def test_wandb_runs_at_its_first_use_not_at_megatrons_import():
    """megatron-core imports wandb at start-up (its inference context and timers); its
    ~1 s runs only when a run logs there."""
    code = ("import sys, megatron_stem.train, megatron.core.timers, wandb; "
            "before = 'wandb.sdk' in sys.modules; wandb.Settings; "
            "print(before, 'wandb.sdk' in sys.modules, callable(wandb.init))")
    assert imports(code) == "False True True"


def test_importing_the_trainer_imports_no_compiler():
    """The ~4 s of TorchDynamo and Inductor are not paid by a rank that never compiles
    (nor is the varlen attention kernel's module, which imports TorchDynamo: the model
    imports it where it runs, on CUDA), DeepSpeed's Muon and megatron's MoE router
    included."""
    code = ("import sys, megatron_stem.train, megatron.core.transformer, "
            "megatron.core.pipeline_parallel.schedules, megatron.core.transformer.moe.router, "
            "deepspeed.runtime.zero.muon.muon_optimizer; "
            "print(any(m in sys.modules for m in ('torch._inductor', 'torch._dynamo')))")
    assert imports(code) == "False"
