"""STEM decoder for Hugging Face transformers (remote code shipped with every export).

Imports only torch and transformers. Numerically it is the megatron-stem model: the same
ops in the same order (RMSNorm via `F.rms_norm`, rotate-half RoPE on q and k, causal SDPA
with grouped-query attention, SwiGLU), so exported logits match the training model's.

A STEM layer's FFN is `down( silu(gate(x)) * table[token_id] )`: the table row of the
*input* token at each position replaces the up-projection. During cached decoding the
positions of a forward are exactly the new tokens, so `input_ids` is all the lookup needs.

Documents packed into one sequence (the training model's `data.reset_position_ids` and
`data.reset_attention_mask`) are given as transformers gives them: `position_ids` that
restart at each document. A forward without a past then keeps attention inside each
document (a dense boolean mask, sized for evaluation rather than for 32k training).

`stem_ids` (optional, as in the megatron model) are the ids the STEM layers look up instead
of `input_ids`, with the text unchanged (knowledge editing): [b, S] for every STEM layer,
or [num_hidden_layers, b, S] with one row per layer. S counts positions from the start of
the sequence, so `generate(..., stem_ids=...)` can pass ids for the prompt once: each
forward reads the columns of its own positions, and positions past S (generated tokens)
read their own rows.
"""

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:  # transformers >= 5: init functions that skip weights already loaded from a checkpoint
    from transformers import initialization as init
except ImportError:  # older transformers only initializes missing weights anyway
    from torch.nn import init

from .configuration_stem import StemConfig
from .rope_scaling import llama3_inv_freq
from .row_cache import RowCache

# transformers 5 renamed the cache field of model outputs from `past_key_values` to `cache`.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ \
    else "past_key_values"


class StemRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rotary_cos_sin(config: StemConfig, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos/sin [b, 1, s, head_dim] of megatron's RoPE (non-interleaved, full dim), with
    Llama 3's frequency scaling when the config has it.

    Computed per call from the config (a handful of flops) rather than held in a buffer,
    so meta-device initialization and `.to()` have nothing to get wrong.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim))
    if config.llama3_rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, **config.llama3_rope_scaling)
    freqs = position_ids[..., None].float() * inv_freq  # [b, s, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class StemAttention(nn.Module):
    def __init__(self, config: StemConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin, mask: Optional[torch.Tensor], cache: Optional[Cache]):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and s > 1 and k.shape[2] == s,
            enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class StemDenseMLP(nn.Module):
    """SwiGLU: down( silu(gate(x)) * up(x) )."""

    def __init__(self, config: StemConfig):
        super().__init__()
        d, ff = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x, lookup_ids):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StemTable(nn.Module):
    """`table[token_id]` rows of one STEM layer, [vocab_size, intermediate_size].

    `host_resident`: the table stays in CPU memory whatever device the model moves to
    (`.to()`, `.cuda()`, or a `device_map` at load time). The model stages the rows a
    forward needs before its first layer (`HostRowStager`); a table called on its own
    gathers its unique rows on the host and copies only those.
    """

    def __init__(self, config: StemConfig):
        super().__init__()
        self.host_resident = bool(config.stem_tables_on_cpu)
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.intermediate_size))
        self.staged = None  # (ids, inverse, rows, ready event) set by HostRowStager

    def forward(self, input_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        if not self.host_resident:
            return F.embedding(input_ids, self.weight)
        staged, self.staged = self.staged, None
        if staged is None or staged[0] is not input_ids:  # not staged for these ids
            unique, inverse = torch.unique(input_ids.cpu(), return_inverse=True)
            rows = self.weight.index_select(0, unique)
            if device.type == "cuda":
                rows = rows.pin_memory()
            return F.embedding(inverse.to(device), rows.to(device, non_blocking=True))
        _, inverse, rows, ready = staged
        if ready is not None:
            torch.cuda.current_stream(device).wait_event(ready)
            for t in (inverse, rows):  # allocated on the copy stream
                t.record_stream(torch.cuda.current_stream(device))
        return F.embedding(inverse, rows)

    def _apply(self, fn, recurse=True):
        if not self.host_resident:
            return super()._apply(fn, recurse)
        # `fn` may move and/or cast (`.to(device, dtype)`, `.cuda()`, `.half()`): probe it on
        # an empty tensor and let only the cast through, so the table never leaves the host.
        dtype = fn(torch.empty(0, dtype=self.weight.dtype)).dtype
        if dtype != self.weight.dtype:
            self.weight.data = self.weight.data.to(dtype)
        return self

    def __setattr__(self, name, value):
        # Loading with a device_map assigns each weight already placed on its target device:
        # bring a table that lands on an accelerator back to the host (one table at a time).
        if (name == "weight" and self.__dict__.get("host_resident") and
                isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta")):
            value = nn.Parameter(value.detach().cpu(), requires_grad=value.requires_grad)
        super().__setattr__(name, value)


class HostRowStager:
    """Stages, at the start of a forward, the rows every host-resident table will look up.

    The ids are deduplicated once for all tables. Rows of ids in the cache (`RowCache`,
    `config.stem_table_cache_rows`: the most frequent ids, on each table's device) are
    read there; the others are gathered on the host and copied, on a GPU from pinned
    memory on a side stream, so the copies for later layers overlap the first layers'
    compute (layer 0 is never STEM). Prefill copies each unique row once; decoding (a few
    new ids per step) is mostly served by the cache. Cached rows are exact copies of the
    table's, so logits do not change; a table modified in place (`_version`) or moved to
    another dtype drops the cache.
    """

    def __init__(self, cache_rows: int):
        self.cache_rows = cache_rows
        self.cache = None
        self._key = None  # what the cache was filled from
        self._streams: dict = {}
        self.hits = self.lookups = 0

    def stage(self, tables: list, devices: list, ids: torch.Tensor) -> None:
        unique, inverse = torch.unique(ids.cpu(), return_inverse=True)
        cache = self._cache(tables, devices)
        if cache is not None:
            self._admit(cache, tables)
            slots = cache.slots(unique)
            hit = slots >= 0
            cache.observe(unique)
            self.hits += int(hit.sum())
            self.lookups += unique.numel()
        else:
            hit = torch.zeros(unique.numel(), dtype=torch.bool)
        missed = unique[~hit]
        joins = {}  # per device: where hits and misses go (the same for every table)
        for i, (table, device) in enumerate(zip(tables, devices)):
            with self._side_stream(device):
                rows = self._copy(table.weight.index_select(0, missed), device)
                if cache is not None and bool(hit.any()):
                    if device not in joins:
                        joins[device] = [x.to(device, non_blocking=True) for x in (
                            hit.nonzero().flatten(), slots[hit], (~hit).nonzero().flatten())]
                    hit_at, hit_slots, miss_at = joins[device]
                    rows = cache.assemble(i, hit_at, hit_slots, miss_at, rows)
                ready = None
                if device.type == "cuda":
                    ready = torch.cuda.Event()
                    ready.record(self._streams[device])
                table.staged = (ids, inverse.to(device, non_blocking=True), rows, ready)

    def _cache(self, tables, devices):
        if self.cache_rows <= 0:
            return None
        key = (tuple(devices), tuple((t.weight.dtype, t.weight._version) for t in tables))
        if key != self._key:  # first use, moved, cast or edited: start over
            vocab = tables[0].weight.shape[0]
            self.cache = RowCache(vocab, min(self.cache_rows, vocab),
                                  [t.weight.shape[1] for t in tables], tables[0].weight.dtype,
                                  devices)
            self._key = key
            for device in devices:  # zero-filled on the compute stream, written on ours
                if device.type == "cuda":
                    self._stream(device).wait_stream(torch.cuda.current_stream(device))
        return self.cache

    def _admit(self, cache, tables) -> None:
        """Bring in the ids that became hot since the last forward."""
        slots = cache.plan()
        if slots.numel():
            ids = cache.id_of[slots]
            for i, table in enumerate(tables):
                device = cache.rows[i].device
                with self._side_stream(device):
                    cache.write(i, slots, self._copy(table.weight.index_select(0, ids), device))

    def _copy(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return rows.to(device)
        return rows.pin_memory().to(device, non_blocking=True)

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream(device))


class StemTableMLP(nn.Module):
    """STEM FFN: down( silu(gate(x)) * table[input_ids] )."""

    def __init__(self, config: StemConfig):
        super().__init__()
        d, ff = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.table = StemTable(config)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x, lookup_ids):
        gate = self.gate_proj(x)
        return self.down_proj(F.silu(gate) * self.table(lookup_ids, gate.device))


class StemDecoderLayer(nn.Module):
    def __init__(self, config: StemConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = StemRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = StemAttention(config, layer_idx)
        self.post_attention_layernorm = StemRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = StemTableMLP(config) if layer_idx in config.stem_layers \
            else StemDenseMLP(config)

    def forward(self, x, lookup_ids, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x), lookup_ids)


class StemPreTrainedModel(PreTrainedModel):
    config_class = StemConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["StemDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, StemTable):
            # Megatron's table init: xavier-normal over the full [vocab, ffn] table.
            init.xavier_normal_(module.weight)


def _documents(position_ids: Optional[torch.Tensor], batch: int,
               past: int) -> Optional[torch.Tensor]:
    """[b, s] index of each token's document when `position_ids` restart within a row
    (documents packed into one sequence, transformers' convention for packed inputs: a new
    document wherever a position is not its predecessor's + 1), else None. Only a forward
    without a past finds documents; tokens decoded after it attend to the whole prompt."""
    if past or position_ids is None:
        return None
    position_ids = position_ids.expand(batch, -1)
    diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    documents = (diff != 1).cumsum(-1)
    return documents if bool(documents[:, -1].any()) else None


def _attention_mask(attention_mask: Optional[torch.Tensor], documents: Optional[torch.Tensor],
                    batch: int, q_len: int, past: int,
                    device: torch.device) -> Optional[torch.Tensor]:
    """A boolean [b, 1, q, past+q] mask (True = attend), or None when SDPA's own causal
    mode (no past) or no mask at all (a single new token) is exact.

    A token attends only within its document (`documents`, from `_documents`), as the
    training model does with `data.reset_attention_mask`. Padded keys are masked; a padded
    query still attends to itself, so its (unused) output stays finite instead of turning
    the next layer's values into NaNs.
    """
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and documents is None and (past == 0 or q_len == 1):
        return None
    kv_len = past + q_len
    q_pos = torch.arange(past, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None].expand(batch, 1, q_len, kv_len)
    if documents is not None:  # no past: queries and keys are the same tokens
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    if padded:
        keys = attention_mask[:, None, None, -kv_len:].to(device=device, dtype=torch.bool)
        mask = mask & (keys | (k_pos == q_pos))
    return mask


def _lookup_ids(stem_ids: Optional[torch.Tensor], input_ids: torch.Tensor, past: int,
                num_layers: int) -> torch.Tensor:
    """The ids STEM layers look up at the positions [past, past + s) of this forward:
    `input_ids` [b, s], or the matching columns of `stem_ids` ([b, S] or [layers, b, S],
    counted from the sequence start); positions past S read their own ids."""
    if stem_ids is None:
        return input_ids
    if stem_ids.dim() not in (2, 3) or stem_ids.shape[-2] != input_ids.shape[0] or (
            stem_ids.dim() == 3 and stem_ids.shape[0] != num_layers):
        raise ValueError(f"stem_ids must be [batch, seq] or [num_hidden_layers={num_layers}, "
                         f"batch, seq] for input_ids {tuple(input_ids.shape)}, got "
                         f"{tuple(stem_ids.shape)}")
    s = input_ids.shape[1]
    window = stem_ids[..., past:past + s].to(input_ids.device)
    if window.shape[-1] == s:
        return window
    own = input_ids[:, window.shape[-1]:]
    if stem_ids.dim() == 3:
        own = own.expand(num_layers, *own.shape)
    return torch.cat([window, own], dim=-1)


class StemModel(StemPreTrainedModel):
    def __init__(self, config: StemConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            StemDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = StemRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.host_rows = HostRowStager(config.stem_table_cache_rows) \
            if config.stem_tables_on_cpu and config.stem_layers else None
        self.post_init()

    def _stage_host_rows(self, ids: torch.Tensor) -> None:
        mlps = [layer.mlp for layer in self.layers if isinstance(layer.mlp, StemTableMLP)]
        self.host_rows.stage([m.table for m in mlps], [m.gate_proj.weight.device for m in mlps],
                             ids)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, past_key_values=None, stem_ids=None,
                **kwargs):
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is None and self.config.stem_layers:
            raise ValueError("a STEM model needs input_ids: its tables are indexed by token id")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        lookup = _lookup_ids(stem_ids, input_ids, past, len(self.layers)) \
            if input_ids is not None else None
        # Stage the ids the tables will look up, before layer 0 (the copies overlap compute);
        # per-layer ids ([layers, b, s]) differ by table: each gathers its own rows.
        if self.host_rows is not None and lookup is not None and lookup.dim() == 2:
            self._stage_host_rows(lookup)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = x.shape[:2]
        documents = _documents(position_ids, b, past)
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=x.device)[None].expand(b, s)
        cos, sin = rotary_cos_sin(self.config, position_ids, x.dtype)
        mask = _attention_mask(attention_mask, documents, b, s, past, x.device)
        for i, layer in enumerate(self.layers):
            ids = lookup[i] if lookup is not None and lookup.dim() == 3 else lookup
            x = layer(x, ids, cos, sin, mask, cache if use_cache else None)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x),
                                       **{_CACHE_FIELD: cache if use_cache else None})


class StemForCausalLM(StemPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: StemConfig):
        super().__init__(config)
        self.model = StemModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                past_key_values=None, stem_ids=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, inputs_embeds=inputs_embeds,
                         cache=cache if cache is not None else past_key_values,
                         use_cache=use_cache, stem_ids=stem_ids)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten().to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)})
