"""The STEM FFN: y = W_down( silu(W_gate x) * U_l[t] ), t = the input token id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from megatron_stem.model.recompute import down_of_recomputed
from megatron_stem.runtime.mcore_versions import mlp_tp_group


@dataclass
class StemMLPSubmodules:
    linear_gate: Union[ModuleSpec, type] = None
    table: Union[ModuleSpec, type] = None
    linear_down: Union[ModuleSpec, type] = None


class StemMLP(MegatronModule):
    """A SwiGLU FFN whose up-projection is replaced by a per-token table lookup.

    Gate is column-parallel, down is row-parallel, the table is column-sliced like the
    gate, so TP needs exactly the collectives of a dense MLP and the lookup none.

    Token ids arrive through megatron's `padding_mask` MLP argument: see `model/gpt.py`
    (`StemGPTModel`) for why that seam and what travels in it.
    """

    def __init__(self, config: TransformerConfig, submodules: StemMLPSubmodules,
                 vocab_size: int, table_seed: int,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None,
                 table_placement: str = "device", recompute_activation: bool = False,
                 pg_collection=None, is_mtp_layer: bool = False, name: Optional[str] = None):
        super().__init__(config=config)
        self.recompute_activation = recompute_activation  # model/recompute.py
        tp_group = get_tensor_model_parallel_group_if_none(mlp_tp_group(tp_group, pg_collection))
        linear_args = dict(config=config, bias=False, skip_bias_add=True, is_expert=False,
                           tp_group=tp_group)
        self.linear_gate = build_module(
            submodules.linear_gate, config.hidden_size, config.ffn_hidden_size,
            init_method=config.init_method, gather_output=False,
            tp_comm_buffer_name="fc1", **linear_args)
        self.table = build_module(
            submodules.table, config=config, num_embeddings=vocab_size,
            ffn_hidden_size=config.ffn_hidden_size, init_seed=table_seed, tp_group=tp_group,
            placement=table_placement)
        self.linear_down = build_module(
            submodules.linear_down, config.ffn_hidden_size, config.hidden_size,
            init_method=config.output_layer_init_method, input_is_parallel=True,
            tp_comm_buffer_name="fc2", **linear_args)
        self.layer_number = None  # 1-based global index, set by TransformerLayer

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                **kwargs):
        token_ids = padding_mask  # full sequence even under SP (see model/gpt.py)
        if token_ids is None:
            raise RuntimeError(
                "a STEM layer ran without token ids: build models with "
                "megatron_stem.model.build_model and pass input_ids on every pipeline stage")
        if token_ids.dim() == 3:  # [num_layers, b, s]: per-layer ids (knowledge editing)
            token_ids = token_ids[self.layer_number - 1]
        # Under SP the gate all-gathers the sequence, so its output covers all s positions.
        gate, _ = self.linear_gate(hidden_states)  # [s, b, ffn/tp]
        rows = self.table(token_ids.t())  # [s, b, ffn/tp]
        if self.recompute_activation:
            return down_of_recomputed(_gated, (gate, rows), self.linear_down)
        return self.linear_down(_gated(gate, rows))


def _gated(gate: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * rows
