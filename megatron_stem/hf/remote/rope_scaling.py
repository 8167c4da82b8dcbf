"""RoPE scaling for `modeling_stem.py`'s `from .rope_scaling import llama3_inv_freq` inside
the package. An export bundles the module itself, `megatron_stem/model/rope_scaling.py`,
under this name (`hf/export.py`): exported code imports only torch and transformers."""

from megatron_stem.model.rope_scaling import llama3_inv_freq

__all__ = ["llama3_inv_freq"]
