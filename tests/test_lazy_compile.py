"""megatron-core's and DeepSpeed's compile decorators compile at a function's first call,
not at import."""

import subprocess
import sys

from megatron_stem import lazy_compile  # before megatron-core: its import installs the hook


def test_the_decorator_runs_once_at_the_first_call():
    applied = []

    def decorator(fn):
        applied.append(fn)
        return lambda x: fn(x) + 1

    @lazy_compile.lazy(decorator)
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


def test_importing_the_trainer_imports_no_compiler():
    """The ~4 s of TorchDynamo and Inductor are not paid by a rank that never compiles
    (nor is the varlen attention kernel's module, which imports TorchDynamo: the model
    imports it where it runs, on CUDA), DeepSpeed's Muon included."""
    code = ("import sys, megatron_stem.train, megatron.core.transformer, "
            "deepspeed.runtime.zero.muon.muon_optimizer; "
            "print(any(m in sys.modules for m in ('torch._inductor', 'torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")[-2]
    assert out == "False"
