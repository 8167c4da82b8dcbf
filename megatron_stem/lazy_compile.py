"""megatron-core's and DeepSpeed's compiled kernels are compiled when first run, not when
they are imported.

megatron-core decorates its fused activations (`megatron.core.fusions.*`) with
`megatron.core.jit.jit_fuser`, which is `torch.compile`; DeepSpeed decorates its Muon
kernels with `deepspeed.runtime.compiler.compile()`, also `torch.compile`, and imports
them in ZeRO's gradient reduction whatever the optimizer. Calling `torch.compile` imports
TorchDynamo and the Inductor backend, about 3 s of CPU per process, whether or not a
compiled function ever runs (a CPU run has the fusions off:
`cpu_compat.transformer_config_overrides`; the recipes train with Adam, not Muon). Every
rank of every job pays it, and the test suite starts about a hundred processes.

`install` (at the package's import, `megatron_stem/__init__.py`) makes both decorators call
`torch.compile` on a function's first call instead. Nothing else changes: a compiled
function is compiled at its first call anyway, with the same arguments, and only those two
decorators are touched, when their modules are loaded (an import hook, so the package's
import does not itself import megatron-core or DeepSpeed).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

# module -> what makes its compile decorator lazy, once the module is loaded
LAZY_DECORATORS = {
    "megatron.core.jit": lambda m: setattr(m, "jit_fuser", lazy(m.jit_fuser)),
    "deepspeed.runtime.compiler": lambda m: setattr(m, "compile", _lazy_maker(m.compile)),
}


def lazy(decorator):
    """`decorator` (of a function) applied at the function's first call."""

    def decorate(fn):
        decorated = None

        @functools.wraps(fn)
        def run(*args, **kwargs):
            nonlocal decorated
            if decorated is None:
                decorated = decorator(fn)
            return decorated(*args, **kwargs)
        run.lazily_decorated = True
        return run
    return decorate


def _lazy_maker(make):
    """`make()` returns a decorator: the same, applied at the function's first call."""
    return lambda *args, **kwargs: lazy(make(*args, **kwargs))


class _Finder(importlib.abc.MetaPathFinder):
    """Loads the modules of `LAZY_DECORATORS` as usual, then makes their decorator lazy."""

    def find_spec(self, name, path=None, target=None):
        if name not in LAZY_DECORATORS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def load(module):
            exec_module(module)
            LAZY_DECORATORS[name](module)
        spec.loader.exec_module = load
        return spec


def install() -> None:
    """Idempotent; a module imported before it keeps its eager decorator."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
