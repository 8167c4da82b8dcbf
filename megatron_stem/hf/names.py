"""The one map between megatron-stem and Hugging Face: parameter names, layouts, config.

Export and import both walk `tensor_map(model)`; neither knows a name this file does not.
Each rule names a megatron tensor (its dist-checkpoint key, which is also its TP=1
parameter name) and the HF tensor(s) it becomes, with the layout change between them:

  same    identical tensor
  vocab   megatron pads embedding/output rows to a multiple of `make_vocab_size_divisible_by`
          (so the vocab splits over TP); HF keeps exactly `vocab_size` rows. Padding rows are
          never a real token: export drops them, import writes zeros there.
  halves  megatron's fused SwiGLU fc1 is [gate; up] stacked on rows
  qkv     megatron's fused qkv is grouped by kv head: for each of the `num_query_groups`
          groups, rows [q heads of the group; k; v] (each head `head_dim` rows)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_stem.config import ModelConfig, from_dict
from megatron_stem.runtime.errors import ConfigError, UserError

MODEL_TYPE = "megatron_stem"
ARCHITECTURE = "StemForCausalLM"
REMOTE_FILES = ("configuration_stem.py", "modeling_stem.py", "row_cache.py", "rope_scaling.py")
AUTO_MAP = {"AutoConfig": "configuration_stem.StemConfig",
            "AutoModelForCausalLM": "modeling_stem.StemForCausalLM"}


@dataclass(frozen=True)
class Rule:
    megatron: str  # "{i}" stands for the (global) layer index
    hf: tuple[str, ...]
    shape: Callable[[ModelConfig], tuple[int, ...]]  # global (TP=1) megatron shape
    layout: str = "same"  # same | vocab | halves | qkv
    when: str = "always"  # always | dense (dense FFN layers) | stem | untied (own output layer)


def _head_dim(m: ModelConfig) -> int:
    return m.hidden_size // m.num_attention_heads


def _vocab_rows(m):
    return (m.padded_vocab_size, m.hidden_size)


def _norm(m):
    return (m.hidden_size,)


def _up(m):
    return (m.ffn_hidden_size, m.hidden_size)


def _down(m):
    return (m.hidden_size, m.ffn_hidden_size)


_L = "model.layers.{i}."
RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _vocab_rows, "vocab"),
    Rule("decoder.layers.{i}.input_layernorm.weight", (_L + "input_layernorm.weight",), _norm),
    Rule("decoder.layers.{i}.self_attention.linear_qkv.weight",
         (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight",
          _L + "self_attn.v_proj.weight"),
         lambda m: ((m.num_attention_heads + 2 * m.kv_heads) * _head_dim(m), m.hidden_size),
         "qkv"),
    Rule("decoder.layers.{i}.self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",),
         lambda m: (m.hidden_size, m.num_attention_heads * _head_dim(m))),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",),
         _norm),
    Rule("decoder.layers.{i}.mlp.linear_fc1.weight",
         (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
         lambda m: (2 * m.ffn_hidden_size, m.hidden_size), "halves", "dense"),
    Rule("decoder.layers.{i}.mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), _down,
         when="dense"),
    Rule("decoder.layers.{i}.mlp.linear_gate.weight", (_L + "mlp.gate_proj.weight",), _up,
         when="stem"),
    Rule("decoder.layers.{i}.mlp.table.weight", (_L + "mlp.table.weight",),
         lambda m: (m.vocab_size, m.ffn_hidden_size), when="stem"),
    Rule("decoder.layers.{i}.mlp.linear_down.weight", (_L + "mlp.down_proj.weight",), _down,
         when="stem"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _norm),
    Rule("output_layer.weight", ("lm_head.weight",), _vocab_rows, "vocab", "untied"),
)


@dataclass(frozen=True)
class TensorMap:
    """One megatron tensor and the HF tensors it maps to, with shapes and converters."""

    megatron: str
    megatron_shape: tuple[int, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]


def _layouts(m: ModelConfig, layout: str, shape: tuple[int, ...]):
    """(hf shapes, to_hf, to_megatron) of one layout for model `m`."""
    if layout == "same":
        return (shape,), lambda t: [t], lambda parts: parts[0]
    if layout == "vocab":
        rows, cols = shape

        def pad(parts):
            (t,) = parts
            return torch.cat([t, t.new_zeros(rows - t.shape[0], cols)])
        return ((m.vocab_size, cols),), lambda t: [t[:m.vocab_size]], pad
    if layout == "halves":
        half = (shape[0] // 2, shape[1])
        return (half, half), lambda t: list(t.chunk(2)), lambda parts: torch.cat(parts)
    if layout == "qkv":
        d, groups, head = m.hidden_size, m.kv_heads, _head_dim(m)
        per_group = m.num_attention_heads // groups  # q heads per kv head

        def split(t):
            q, k, v = t.view(groups, per_group + 2, head, d).split([per_group, 1, 1], dim=1)
            return [x.reshape(-1, d) for x in (q, k, v)]

        def fuse(parts):
            q, k, v = (p.view(groups, -1, head, d) for p in parts)
            return torch.cat([q, k, v], dim=1).reshape(-1, d)
        shapes = ((m.num_attention_heads * head, d), (groups * head, d), (groups * head, d))
        return shapes, split, fuse
    raise ValueError(f"unknown layout {layout!r}")  # a bug in RULES


def tensor_map(m: ModelConfig) -> list[TensorMap]:
    """Every tensor of model `m`, in model order: embedding, layers, final norm, head."""
    stem = set(m.stem_layer_indices)

    def applies(rule: Rule, i: int | None = None) -> bool:
        return {"always": True, "untied": m.untie_embeddings,
                "dense": i not in stem, "stem": i in stem}[rule.when]

    def build(rule: Rule, i: int | None = None) -> TensorMap:
        shape = rule.shape(m)
        hf_shapes, to_hf, to_megatron = _layouts(m, rule.layout, shape)
        return TensorMap(rule.megatron.format(i=i), shape, tuple(h.format(i=i) for h in rule.hf),
                         hf_shapes, to_hf, to_megatron)

    embedding, *closing = [r for r in RULES if "{i}" not in r.megatron]
    per_layer = [r for r in RULES if "{i}" in r.megatron]
    return ([build(embedding)]
            + [build(r, i) for i in range(m.num_layers) for r in per_layer if applies(r, i)]
            + [build(r) for r in closing if applies(r)])


# ---------------------------------------------------------------------------------------
# Config: ModelConfig <-> HF config.json
# ---------------------------------------------------------------------------------------
# A STEM model exports as our own architecture (remote code); a dense one is a Llama and
# exports as transformers' own LlamaForCausalLM. Both import.

LLAMA_TYPE = "llama"
LLAMA_ARCHITECTURE = "LlamaForCausalLM"

# ModelConfig field -> HF config key, where the meaning is the same.
CONFIG_FIELDS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "seq_length": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "init_std": "initializer_range",
}
# What HF cannot say in its own terms, kept verbatim so an import rebuilds the exact recipe
# (a resumed run compares the recipe with the checkpoint's, field by field).
MEGATRON_KEY = "megatron_stem"
_VERBATIM = ("stem_layers", "num_query_groups", "make_vocab_size_divisible_by", "rotary_base")
_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# A Llama that is not this architecture: (config key, the only value we build, its default).
_LLAMA_FIXED = (("hidden_act", "silu", "silu"), ("attention_bias", False, False),
                ("mlp_bias", False, False))


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """config.json of an export of model `m` whose weights are stored in `dtype`."""
    shared = {
        **{hf: getattr(m, ours) for ours, hf in CONFIG_FIELDS.items()},
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.hidden_size // m.num_attention_heads,
        # megatron builds its RoPE with int(rotary_base): export the base it really used.
        "rope_theta": float(int(m.rotary_base)),
        "tie_word_embeddings": not m.untie_embeddings,
    }
    scaling = {k: getattr(m.rope_scaling, k) for k in _SCALING} if m.rope_scaling else None
    verbatim = {MEGATRON_KEY: {k: getattr(m, k) for k in _VERBATIM}}
    if not m.is_stem:
        return {"architectures": [LLAMA_ARCHITECTURE], "model_type": LLAMA_TYPE, **shared,
                "rope_scaling": {"rope_type": "llama3", **scaling} if scaling else None,
                **{key: value for key, value, _ in _LLAMA_FIXED},
                # LlamaConfig would make up bos 1 / eos 2; a tokenizer's export sets them.
                "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
                "use_cache": True, "dtype": dtype, **verbatim}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "auto_map": dict(AUTO_MAP),
        **shared,
        "llama3_rope_scaling": scaling,
        "stem_layers": m.stem_layer_indices,
        "stem_tables_on_cpu": False,
        "stem_table_cache_rows": 0,
        "use_cache": True,
        "dtype": dtype,
        **verbatim,
    }


def model_config(hf: dict, source: str = "config.json") -> ModelConfig:
    """The ModelConfig of an HF config.json: a megatron-stem export (possibly re-saved by
    HF), or a dense Llama (ours or anyone's)."""
    kind = hf.get("model_type")
    if kind not in (MODEL_TYPE, LLAMA_TYPE):
        raise UserError(f"{source}: model_type is {kind!r}; only {MODEL_TYPE!r} (a megatron-stem "
                        f"export) and {LLAMA_TYPE!r} import")
    llama = kind == LLAMA_TYPE
    if llama:  # dense; and keys transformers' LlamaConfig may leave out, at its defaults
        hf = {"tie_word_embeddings": False, **hf, "stem_layers": [],
              "num_key_value_heads": hf.get("num_key_value_heads") or hf.get("num_attention_heads")}
        for key, ours, default in _LLAMA_FIXED:
            if hf.get(key, default) != ours:
                raise UserError(f"{source}: {key} is {hf[key]!r}; only {ours!r} imports")
    missing = [k for k in (*CONFIG_FIELDS.values(), "num_key_value_heads", "stem_layers",
                           "tie_word_embeddings") if k not in hf]
    if missing:
        raise UserError(f"{source}: missing {', '.join(missing)}")
    theta, scaling = _llama_rope(hf, source) if llama else \
        (hf.get("rope_theta"), hf.get("llama3_rope_scaling"))
    if theta is None:
        raise UserError(f"{source}: missing rope_theta")
    if float(theta) != int(theta):  # megatron-core's RoPE takes an integer base
        raise UserError(f"{source}: rope_theta {theta} is not an integer")
    data = {ours: hf[key] for ours, key in CONFIG_FIELDS.items()}
    data.update(num_query_groups=hf["num_key_value_heads"],
                stem_layers=list(hf["stem_layers"]) or "none", rotary_base=theta,
                rope_scaling=scaling, untie_embeddings=not hf["tie_word_embeddings"])
    verbatim = hf.get(MEGATRON_KEY) or {}
    try:
        m = from_dict(ModelConfig, {**data, **verbatim})
    except ConfigError as e:
        raise UserError(f"{source}: {e}") from None
    # The verbatim block only respells what the HF fields say; it must not contradict them.
    if (m.stem_layer_indices != sorted(hf["stem_layers"]) or m.kv_heads != hf["num_key_value_heads"]
            or float(int(m.rotary_base)) != float(theta)):
        raise UserError(f"{source}: '{MEGATRON_KEY}' disagrees with stem_layers, "
                        "num_key_value_heads or rope_theta")
    if hf.get("head_dim", m.hidden_size // m.num_attention_heads) * m.num_attention_heads \
            != m.hidden_size:
        raise UserError(f"{source}: head_dim x num_attention_heads must equal hidden_size")
    return m


def _llama_rope(hf: dict, source: str) -> tuple[Optional[float], Optional[dict]]:
    """RoPE base and llama3 scaling of a Llama config.json, in either spelling: the hub's
    `rope_theta` + `rope_scaling`, or transformers 5's `rope_parameters` (theta inside)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"{source}: partial_rotary_factor {rope['partial_rotary_factor']} is "
                        "not supported (RoPE over the whole head only)")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UserError(f"{source}: RoPE scaling of type {kind!r} is not supported (only "
                        "'llama3')")
    scaling = {k: rope[k] for k in _SCALING if k in rope}
    scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return theta, scaling
