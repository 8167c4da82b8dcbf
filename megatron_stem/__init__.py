"""megatron-stem: STEM transformers (per-token FFN tables) on megatron-core and DeepSpeed."""

from megatron_stem import quiet

__version__ = "0.1.0"

quiet.install()  # before any module of ours imports megatron-core or DeepSpeed (see quiet.py)
