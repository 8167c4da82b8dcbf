"""Causal self-attention through `torch.nn.functional.scaled_dot_product_attention`.

megatron-core's local `DotProductAttention` materializes the [b, heads, s, s] scores;
SDPA dispatches to flash / memory-efficient kernels on GPU and a fused kernel on CPU, with
grouped-query attention built in. Without Transformer Engine this is the fast path.
With document boundaries (`data.reset_attention_mask`, model/documents.py) attention stays
inside each document.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_stem.model import documents


class SDPAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        mask_type = attn_mask_type or self.attn_mask_type
        within_documents = documents.is_document_mask(packed_seq_params)
        if (mask_type != AttnMaskType.causal or query.shape[0] != key.shape[0]
                or attention_bias is not None
                or (packed_seq_params is not None and not within_documents)):
            # Not plain causal self-attention (e.g. incremental decode): the reference path.
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        dropout = self.attention_dropout.p if self.training else 0.0
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if within_documents:
            if dropout:
                raise ValueError("document masking runs without attention dropout "
                                 "(the variable-length kernel has none)")
            context = documents.attend(query, key, value, packed_seq_params,
                                       self.softmax_scale, groups > 1)
            return self._merge_heads(context, query)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]

        def attend():
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                enable_gqa=groups > 1)

        if dropout and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        return self._merge_heads(context.permute(2, 0, 1, 3), query)

    def _merge_heads(self, context, query):
        """[s, b, heads, d] -> [s, b, heads x d], megatron's core-attention output."""
        sq, b = query.shape[:2]
        return context.reshape(sq, b, self.hidden_size_per_partition)
