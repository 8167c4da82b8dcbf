"""What megatron-core and DeepSpeed load at import, but a run may never use, is loaded at
first use.

Every rank of every job pays its start-up, and the test suite starts about a hundred
processes; two things made up about 4 s of CPU of each process's start:

- **Compilers.** megatron-core decorates its fused activations (`megatron.core.fusions.*`)
  with `megatron.core.jit.jit_fuser`, which is `torch.compile`; DeepSpeed decorates its
  Muon kernels with `deepspeed.runtime.compiler.compile()`, also `torch.compile`, and
  imports them in ZeRO's gradient reduction whatever the optimizer. Calling
  `torch.compile` imports TorchDynamo and the Inductor backend (about 3 s), whether or not
  a compiled function ever runs (a CPU run has the fusions off:
  `cpu_compat.transformer_config_overrides`; the recipes train with Adam, not Muon). Both
  decorators call `torch.compile` on a function's first call instead: a compiled function
  is compiled at its first call anyway, with the same arguments. megatron-core 0.19 also
  decorates its MoE inference router with a bare `@torch.compile` (`transformer/moe/
  router.py`, imported by the pipeline schedules whatever the model): while that module
  runs, `torch.compile` is the same lazy decorator (`LAZY_TORCH_COMPILE`).
- **Weights & Biases.** megatron-core's inference context and timers `import wandb` at
  import time (~1 s: its settings are pydantic models that read their own source) and
  touch it only when told to log there. `wandb`'s code runs at the first use of one of its
  attributes, which a run with `metrics.wandb_project` makes (`training/wandb_run.py`) and
  another never does. (Not `importlib.util.LazyLoader`: its module loads at any attribute
  read, `__spec__` included, and Python reads that at every later `import wandb`.)

Only these are touched, when they are first imported (an import hook, so the package's
import does not itself import megatron-core, DeepSpeed or wandb).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types

# module -> what makes its compile decorator lazy, once the module is loaded
LAZY_DECORATORS = {
    "megatron.core.jit": lambda m: setattr(m, "jit_fuser", lazy(m.jit_fuser)),
    "deepspeed.runtime.compiler": lambda m: setattr(m, "compile", _lazy_maker(m.compile)),
}
# modules whose own code calls `torch.compile` as it runs (a bare decorator)
LAZY_TORCH_COMPILE = ("megatron.core.transformer.moe.router",)
# top-level modules whose code runs at the first use of one of their attributes
LAZY_MODULES = ("wandb",)


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


def _lazy_compile(compile_):
    """`torch.compile`, as `@torch.compile` or `@torch.compile(...)`, applied at the
    function's first call."""

    def compile(model=None, **kwargs):
        decorate = lazy(lambda fn: compile_(fn, **kwargs))
        return decorate if model is None else decorate(model)
    return compile


def _with_lazy_torch_compile(exec_module):
    def load(module):
        import torch

        compile_ = torch.compile
        torch.compile = _lazy_compile(compile_)
        try:
            exec_module(module)
        finally:
            torch.compile = compile_
    return load


class _LoadedAtFirstUse(types.ModuleType):
    """A module whose code runs, in this same module object, when an attribute it does not
    have yet is first read. The import system's own attributes (`__spec__`, `__name__`,
    `__path__`, ...) are there from the start and load nothing."""

    def __getattr__(self, attr):
        loader = self.__dict__.pop("_loader_at_first_use", None)
        if loader is None:  # loaded (or loading): a missing attribute is missing
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        self.__spec__.loader = self.__loader__ = loader
        loader.exec_module(self)
        return getattr(self, attr)


class _AtFirstUse(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return _LoadedAtFirstUse(spec.name)

    def exec_module(self, module):
        module._loader_at_first_use = self.loader


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules of `LAZY_DECORATORS`, `LAZY_TORCH_COMPILE` and `LAZY_MODULES` as
    usual, and changes how they are loaded."""

    def find_spec(self, name, path=None, target=None):
        if name not in LAZY_DECORATORS and name not in LAZY_MODULES \
                and name not in LAZY_TORCH_COMPILE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        if name in LAZY_MODULES:
            spec.loader = _AtFirstUse(spec.loader)
            return spec
        exec_module = spec.loader.exec_module
        if name in LAZY_TORCH_COMPILE:
            spec.loader.exec_module = _with_lazy_torch_compile(exec_module)
            return spec

        def load(module):
            exec_module(module)
            LAZY_DECORATORS[name](module)
        spec.loader.exec_module = load
        return spec


def install() -> None:
    """Idempotent; a module imported before it is left as it was loaded."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
