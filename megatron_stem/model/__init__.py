from megatron_stem.model.gpt import StemGPTModel, build_model, transformer_config

__all__ = ["StemGPTModel", "build_model", "transformer_config"]
