"""megatron-core's fused kernels are compiled when first run, not when they are imported.

megatron-core decorates its fused activations (`megatron.core.fusions.*`) with
`megatron.core.jit.jit_fuser`, which is `torch.compile`. Calling `torch.compile` imports
TorchDynamo and the Inductor backend, about 3 s of CPU per process, at the import of
megatron-core's transformer config, whether or not a fused kernel ever runs (a CPU run has
the fusions off: `cpu_compat.transformer_config_overrides`). Every rank of every job pays
it, and the test suite starts about a hundred processes.

`install` (at the package's import, `megatron_stem/__init__.py`) makes `jit_fuser` call
`torch.compile` on a function's first call instead. Nothing else changes: a compiled
function is compiled at its first call anyway, with the same arguments, and only megatron's
`jit_fuser` is touched, when its module is loaded (an import hook, so the package's import
does not itself import megatron-core).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

JIT_MODULE = "megatron.core.jit"


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


class _JitFinder(importlib.abc.MetaPathFinder):
    """Loads megatron.core.jit as usual, then makes its `jit_fuser` lazy."""

    def find_spec(self, name, path=None, target=None):
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def load(module):
            exec_module(module)
            module.jit_fuser = lazy(module.jit_fuser)
        spec.loader.exec_module = load
        return spec


def install() -> None:
    """Idempotent; a no-op once megatron.core.jit is imported (its decorators then ran)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _JitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())
