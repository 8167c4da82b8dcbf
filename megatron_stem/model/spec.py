"""Layer specs: one builder for STEM and dense layers, so a STEM model and its dense
baseline differ only in `ModelConfig.stem_layers`."""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_stem.config import ModelConfig
from megatron_stem.model.attention import SDPAttention
from megatron_stem.model.norm import RMSNorm
from megatron_stem.model.recompute import down_of_recomputed, swiglu
from megatron_stem.model.stem_mlp import StemMLP, StemMLPSubmodules
from megatron_stem.model.table import StemTable
from megatron_stem.runtime.mcore_versions import mlp_tp_group


def table_seed(seed: int, layer_index: int) -> int:
    """Init seed of layer `layer_index`'s table: the same on every rank and TP size."""
    return seed * 1_000_003 + layer_index


class SwiGLUMLP(MLP):
    """megatron's dense MLP (SwiGLU, no bias), whose activation may be recomputed in
    backward (model/recompute.py)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules,
                 tp_group=None, recompute_activation: bool = False, pg_collection=None,
                 is_mtp_layer: bool = False, name: str | None = None):
        super().__init__(config=config, submodules=submodules,
                         tp_group=mlp_tp_group(tp_group, pg_collection))
        self.recompute_activation = recompute_activation

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self.recompute_activation:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        fc1_output, _ = self.linear_fc1(hidden_states)
        return down_of_recomputed(swiglu, (fc1_output,), self.linear_fc2)


def dense_mlp_spec(recompute_activation: bool = False) -> ModuleSpec:
    return ModuleSpec(module=SwiGLUMLP, params={"recompute_activation": recompute_activation},
                      submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                               linear_fc2=RowParallelLinear))


def stem_mlp_spec(vocab_size: int, seed: int, table_placement: str = "device",
                  recompute_activation: bool = False) -> ModuleSpec:
    return ModuleSpec(
        module=StemMLP,
        params={"vocab_size": vocab_size, "table_seed": seed,
                "table_placement": table_placement,
                "recompute_activation": recompute_activation},
        submodules=StemMLPSubmodules(
            linear_gate=ColumnParallelLinear, table=StemTable, linear_down=RowParallelLinear))


def layer_spec(mlp: ModuleSpec) -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPAttention,
                    linear_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add))


def block_spec(model: ModelConfig, config: TransformerConfig, seed: int,
               pp_rank: int | None = None, table_placement: str = "device",
               recompute_activation: bool = False) -> TransformerBlockSubmodules:
    """Specs of the layers held by pipeline stage `pp_rank` (default: this rank's);
    `table_placement` as `tables.placement`; `recompute_activation`: the FFNs' activation
    recomputed in backward (`parallel.recompute_modules: [mlp_act]`)."""
    first = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    stem = set(model.stem_layer_indices)
    specs = [
        layer_spec(stem_mlp_spec(model.vocab_size, table_seed(seed, i), table_placement,
                                 recompute_activation)
                   if i in stem else dense_mlp_spec(recompute_activation))
        for i in range(first, first + count)
    ]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)
