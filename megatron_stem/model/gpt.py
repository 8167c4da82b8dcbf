"""The STEM decoder: megatron-core's GPTModel plus the token-id seam."""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_stem.config import (
    ModelConfig,
    ParallelConfig,
    RopeScalingConfig,
    TableStorageConfig,
)
from megatron_stem.model import documents
from megatron_stem.model.host_copy import HostCopy
from megatron_stem.model.init import truncated_fan_in_
from megatron_stem.model.loss import chunked_lm_loss
from megatron_stem.model.rope_scaling import llama3_inv_freq
from megatron_stem.model.spec import block_spec
from megatron_stem.model.table import StemTable
from megatron_stem.runtime import cpu_compat
from megatron_stem.runtime.parallel import seed_random_streams

# `parallel.recompute_modules` that megatron's TransformerConfig does itself: the attention
# core (softmax(QK^T)V), and the whole MLP (STEM's gets its token ids through the
# checkpointed call's `padding_mask`, see StemGPTModel).
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "mlp")


class StemGPTModel(GPTModel):
    """GPTModel that delivers the input token ids to every STEM MLP.

    THE SEAM. megatron-core (0.16.1-0.19) calls an MLP with `hidden_states` and `padding_mask`,
    and threads `padding_mask` through every layer, through activation recompute (as a
    checkpointed tensor argument, so the replay sees the same ids) and on every pipeline
    stage (each stage's forward receives it, so nothing global can go stale under 1F1B).
    We put the input token ids [b, s] in that slot. They stay the full sequence even under
    sequence parallelism, where the base class would scatter a padding mask: the STEM gate
    all-gathers the sequence before the lookup, so the table needs every position and no
    collective. Only `StemMLP` reads the slot; dense MLPs ignore it. MoE layers, which
    would read it as a padding mask, are not part of this model.

    Consequence for callers: pass `input_ids` on every pipeline stage, not only the first.

    Documents (model/documents.py): `position_ids` [b, s], when given, are the positions
    RoPE rotates by (megatron's GPTModel ignores them for RoPE and uses the index in the
    row); `packed_seq_params` from `documents.document_boundaries` keep attention inside
    each document. Like `input_ids`, both go to every pipeline stage.

    `stem_ids` (optional) are the ids the STEM layers look up instead of `input_ids`, with
    the text unchanged: [b, s] for every STEM layer, or [num_layers, b, s] with one row per
    (global) layer, so an edit can reach chosen layers only (knowledge editing).
    """

    def __init__(self, *args, loss_chunk_tokens: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_chunk_tokens = loss_chunk_tokens  # parallel.loss_chunk_tokens

    def forward(self, input_ids, position_ids=None, attention_mask=None, *args,
                stem_ids=None, **kwargs):
        if kwargs.get("padding_mask") is not None:
            raise ValueError("StemGPTModel uses the padding_mask slot for token ids; "
                             "padding masks are not supported")
        kwargs["padding_mask"] = stem_ids  # _preprocess falls back to input_ids
        return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        stem_ids = input_ids if padding_mask is None else padding_mask
        if documents.is_document_mask(packed_seq_params):
            packed_seq_params = None  # only attention reads them (megatron would size RoPE by them)
        out = super()._preprocess(input_ids, position_ids, decoder_input, inference_context,
                                  packed_seq_params, padding_mask=None)
        rotary = out[1]
        if position_ids is not None and rotary is not None and inference_context is None:
            rotary = documents.rotary_at(rotary, position_ids)
        return (out[0], rotary, *out[2:5], stem_ids, *out[6:])

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, **kwargs):
        """With `loss_chunk_tokens` and labels, the loss in chunks of positions
        (model/loss.py), equal to megatron's; otherwise megatron's logits or loss."""
        if (labels is None or not self.loss_chunk_tokens or not self.post_process
                or kwargs.get("mtp_in_postprocess") or kwargs.get("inference_context")):
            return super()._postprocess(hidden_states, input_ids, position_ids, labels,
                                        **kwargs)
        weight = self.shared_embedding_or_output_weight() \
            if self.share_embeddings_and_output_weights else self.output_layer.weight
        return chunked_lm_loss(hidden_states, weight, labels, self.loss_chunk_tokens,
                               self.config.sequence_parallel)


def transformer_config(model: ModelConfig, parallel: ParallelConfig,
                       params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    recompute = {}
    if parallel.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    elif parallel.recompute == "selective":  # mlp_act is ours (model/recompute.py)
        recompute = dict(recompute_granularity="selective", recompute_modules=[
            m for m in parallel.recompute_modules if m in MEGATRON_RECOMPUTE_MODULES])
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.kv_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        sequence_parallel=parallel.sequence_parallel,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype if parallel.pipeline_parallel > 1 else None,
        # The DeepSpeed engine owns gradients (no megatron DDP main_grad buffers).
        gradient_accumulation_fusion=False,
        # STEM and dense layers alternate: checkpoint each layer under its own key.
        hetereogenous_dist_checkpoint=True,
        **recompute,
        **cpu_compat.transformer_config_overrides(),
    )


def build_model(model: ModelConfig, parallel: ParallelConfig, seed: int = 1234,
                params_dtype: torch.dtype = torch.float32,
                tables: Optional[TableStorageConfig] = None) -> StemGPTModel:
    """This rank's part of the model (its TP shard of its pipeline stage), initialized per
    `model.init`. With `tables.placement: host` the STEM tables go to host memory shared
    per node. Every build starts from `seed`'s weights, however many came before it in the
    process."""
    seed_random_streams(seed)
    config = transformer_config(model, parallel, params_dtype)
    placement = tables.placement if tables is not None else "device"
    _quiet_unknown_mlp_warning()
    net = StemGPTModel(
        config=config,
        transformer_layer_spec=block_spec(
            model, config, seed, table_placement=placement,
            recompute_activation=parallel.recompute == "selective"
            and "mlp_act" in parallel.recompute_modules),
        vocab_size=model.padded_vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not model.untie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rotary_base),
        loss_chunk_tokens=parallel.loss_chunk_tokens,
    )
    if model.init == "truncated_fan_in":
        truncated_fan_in_(net, seed)
    if model.rope_scaling is not None:
        scale_rope(net.rotary_pos_emb, model.rope_scaling)
    if placement == "host":
        place_tables_on_host(net, tables.ranks_per_copy)
    if torch.cuda.is_available():
        net.cuda(torch.cuda.current_device())
    return net


def scale_rope(rotary: torch.nn.Module, scaling: RopeScalingConfig) -> None:
    """Llama 3's frequency scaling in megatron's RotaryEmbedding, before its first forward
    (which caches what it computes from `inv_freq`). megatron-core's own `rope_scaling`
    fixes three of the four parameters to Llama 3.1's, so the frequencies are set here."""
    rotary.inv_freq = llama3_inv_freq(
        rotary.inv_freq, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
        scaling.original_max_position_embeddings)


def place_tables_on_host(net: torch.nn.Module, ranks_per_copy: int = 0) -> HostCopy:
    """Allocate every host-placed STEM table in memory shared by its copy's ranks, with its
    initial values (written once per copy)."""
    copy = HostCopy(ranks_per_copy)
    for name, module in net.named_modules():
        if isinstance(module, StemTable) and module.placement == "host":
            init = module.init_table_ if module.perform_initialization else None
            module.set_host_weight(copy.tensor(f"{name}.weight", tuple(module.weight.shape),
                                               init))
            module.host_copy = copy
    return copy


class _DropUnknownStemMLP(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


def _quiet_unknown_mlp_warning() -> None:
    """megatron-core 0.16-0.17's TransformerLayer warns 'Unknown MLP type' for any MLP class
    it does not list; for ours that is expected (they take their TP group from
    parallel_state: mcore_versions.mlp_tp_group), not a problem."""
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    if not any(isinstance(f, _DropUnknownStemMLP) for f in logger.filters):
        logger.addFilter(_DropUnknownStemMLP())
