"""Hugging Face config of a megatron-stem model (STEM or dense Llama-style decoder).

Written into every export by `tools/to_hf.py` and loaded with `trust_remote_code=True`.
Imports only transformers. Field names follow Llama's where the meaning is the same, so
tools that read `hidden_size`, `num_hidden_layers`, `max_position_embeddings`, ... work.
"""

from transformers import PretrainedConfig


class StemConfig(PretrainedConfig):
    """A decoder whose FFNs are SwiGLU, except in `stem_layers`, where the up-projection is
    replaced by a per-layer table indexed by the input token id:
    `y = down( silu(gate(x)) * table[token_id] )`, table of shape [vocab_size, intermediate_size].

    `stem_tables_on_cpu`: keep the tables in host memory whatever device the model is moved
    to, and copy to the compute device only the rows a forward looks up (for GPUs too small
    to hold the tables). Pass it to `from_pretrained(..., stem_tables_on_cpu=True)`.

    `stem_table_cache_rows`: with `stem_tables_on_cpu`, keep this many rows of each table
    on the compute device for the most frequent ids (LFU with aging), so that decoding is
    served mostly from device memory; 0 = no cache.

    `llama3_rope_scaling`: None for plain RoPE, or Llama 3's frequency scaling as
    {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} (under
    its own key: transformers 5 reserves `rope_scaling` for its own RoPE machinery).
    """

    model_type = "megatron_stem"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=None,
                 head_dim=None, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 rope_theta=500000.0, llama3_rope_scaling=None, initializer_range=0.02,
                 stem_layers=(), stem_tables_on_cpu=False, stem_table_cache_rows=0,
                 use_cache=True, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.llama3_rope_scaling = dict(llama3_rope_scaling) if llama3_rope_scaling else None
        self.initializer_range = initializer_range
        self.stem_layers = sorted(int(i) for i in stem_layers)
        self.stem_tables_on_cpu = stem_tables_on_cpu
        self.stem_table_cache_rows = int(stem_table_cache_rows)
        self.use_cache = use_cache
        self.hidden_act = "silu"
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
