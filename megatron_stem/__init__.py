"""megatron-stem: STEM transformers (per-token FFN tables) on megatron-core and DeepSpeed."""

__version__ = "0.1.0"
