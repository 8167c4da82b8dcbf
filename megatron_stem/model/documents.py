"""Document masking: where the documents packed into a micro-batch begin and end, causal
attention that stays inside each one, and RoPE at each token's position in its document.

megatron's GPTDataset packs documents end to end, each closed by the tokenizer's EOD
token, so a sample's rows cross document boundaries. With `data.reset_attention_mask` a
token attends only to the earlier tokens of its own document; the EOD token belongs to
the document it ends (megatron's `_get_ltor_masks_and_position_ids` rule: the tokens after
an EOD see nothing up to and including it).

The boundaries travel in megatron's own slot for packed sequences, `PackedSeqParams`,
which `GPTModel.forward` hands to every layer's core attention: as a Python object held
by the recompute closure (not saved as a checkpointed tensor, so nothing is lost when
`parallel.recompute: full` replays a layer), given to each pipeline stage's forward with
its own micro-batch, and untouched by sequence parallelism (attention sees the whole
sequence after the QKV projection's gather). We use the `sbhd` format, where megatron
leaves tensors, RoPE and the layout alone: `cu_seqlens` are the document starts in the
batch-major flattening of the [b, s] micro-batch (row ends are document ends too), and
`max_seqlen` the longest document, both computed on the host by the data loader.
megatron's `thd` format is not used: it needs one row per micro-batch and applies RoPE
per document in a Python loop with a host sync on every layer.

`attend` is the one place the attention kernel is chosen (docs/design.md, "Document
masking", says why this one and what a GPU measurement has to confirm):
- on a CUDA device in bf16/fp16: `torch.nn.attention.varlen.varlen_attn`, the
  flash-attention variable-length kernel that ships with torch (the kernel SDPA's flash
  backend runs, with per-document sequence starts): work grows with the sum of squared
  document lengths, no [s, s] mask exists, nothing is compiled;
- elsewhere (CPU, fp32): SDPA with a dense boolean [b, 1, s, s] mask built from the same
  boundaries. Exact and fine at CPU sizes; at 32k it would cost a gigabyte per row.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

# PackedSeqParams.qkv_format of document boundaries (megatron reads `thd` only).
FORMAT = "sbhd"


def document_boundaries(tokens: torch.Tensor, eod: int,
                        device: torch.device | str = "cpu") -> PackedSeqParams:
    """The documents of a [b, s] micro-batch of token ids (on the host), split after each
    EOD token and at each row end, as `PackedSeqParams` on `device`."""
    ids = np.asarray(tokens)
    b, s = ids.shape
    starts = np.zeros((b, s), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eod
    cu = np.append(np.flatnonzero(starts), b * s).astype(np.int32)
    longest = int(np.diff(cu).max())
    cu_seqlens = torch.from_numpy(cu).to(device, non_blocking=True)
    return PackedSeqParams(qkv_format=FORMAT, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def is_document_mask(packed_seq_params) -> bool:
    return packed_seq_params is not None and packed_seq_params.qkv_format == FORMAT


def document_ids(documents: PackedSeqParams, batch: int, seq: int) -> torch.Tensor:
    """[b, s] index of each token's document (numbered over the whole micro-batch)."""
    cu = documents.cu_seqlens_q
    tokens = torch.arange(batch * seq, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:], tokens, right=True).view(batch, seq)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           documents: PackedSeqParams, scale: float | None, gqa: bool) -> torch.Tensor:
    """Causal attention within documents. query [s, b, heads, d], key/value
    [s, b, kv heads, d] (megatron's layout); returns [s, b, heads, d]."""
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        return _varlen(query, key, value, documents, scale, gqa)
    return _dense_mask(query, key, value, documents, scale, gqa)


def _varlen(query, key, value, documents: PackedSeqParams, scale, gqa) -> torch.Tensor:
    # Imported where it runs (CUDA only): its module imports TorchDynamo, 1-2 s of every
    # process's start otherwise.
    from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415

    s, b = query.shape[:2]
    # [s, b, h, d] -> [b*s, h, d], batch-major like cu_seqlens (a view when b == 1)
    q, k, v = (t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value))
    cu, longest = documents.cu_seqlens_q, documents.max_seqlen_q
    out = _call_varlen(varlen_attn, q, k, v, cu, longest, scale, gqa)
    return out.view(b, s, *out.shape[1:]).transpose(0, 1)


def _call_varlen(varlen_attn, q, k, v, cu, longest, scale, gqa) -> torch.Tensor:
    """Causal `varlen_attn` in the keywords this torch release has. 2.13's takes
    `window_size` ((-1, 0): causal), `scale` and `enable_gqa`; earlier releases take
    `is_causal` and may lack the other two: the key/value heads are then repeated for
    each query group, and the queries scaled so that its default 1/sqrt(d) gives `scale`."""
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif gqa:
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    if scale is not None and "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None:
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)


def _dense_mask(query, key, value, documents: PackedSeqParams, scale, gqa) -> torch.Tensor:
    s, b = query.shape[:2]
    ids = document_ids(documents, b, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
    mask = (ids[:, :, None] == ids[:, None, :]) & causal  # [b, q, k]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=gqa)
    return out.permute(2, 0, 1, 3)


def rotary_at(freqs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """megatron's RoPE table [s, 1, 1, d] (positions 0..s-1) read at each token's own
    position: [s, b, 1, d], which megatron's rotary code broadcasts over heads as it does
    the shared table. How `data.reset_position_ids` reaches RoPE: megatron's GPTModel
    ignores position_ids for RoPE and rotates by index in the row."""
    return freqs[:, 0, 0][position_ids.t().to(freqs.device)].unsqueeze(2)
