"""megatron-stem: STEM transformers (per-token FFN tables) on megatron-core and DeepSpeed."""

from megatron_stem.runtime import lazy_imports, warning_filters

__version__ = "0.1.0"

# Both before any module of ours imports megatron-core or DeepSpeed (see each module).
warning_filters.install()
lazy_imports.install()
