"""megatron-stem: STEM transformers (per-token FFN tables) on megatron-core and DeepSpeed."""

from megatron_stem import lazy_imports, quiet

__version__ = "0.1.0"

# Both before any module of ours imports megatron-core or DeepSpeed (see each module).
quiet.install()
lazy_imports.install()
