"""The recipe's schema: one dataclass per section, each with its ranges and its rules
across fields (`validate`), the recipe's (`Recipe.validate`) across sections."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional, Union

from megatron_stem.config.strict import Range, from_dict, read_mapping
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.runtime.errors import ConfigError

# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------

StemPlacement = Union[Literal["none", "1/3", "1/2", "full"], list[int]]

# Fraction placements: every n-th layer starting at layer 1. Layer 0 is never STEM: the
# paper keeps the first FFN dense, and its ids would carry no context yet.
_PLACEMENT_STRIDE = {"1/3": 3, "1/2": 2, "full": 1}


@dataclass
class RopeScalingConfig:
    """Llama 3's RoPE frequency scaling (Hugging Face `rope_scaling` of type `llama3`):
    wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
    stretched by `factor`, those shorter than `... / high_freq_factor` kept, and the ones
    between interpolated. Llama-3.2-1B: factor 32, 1, 4, 8192."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    type: Literal["llama3"] = "llama3"

    def validate(self) -> None:
        if self.factor < 1:
            raise ConfigError(f"factor: must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"high_freq_factor: must exceed low_freq_factor > 0, got "
                              f"{self.high_freq_factor} and {self.low_freq_factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("original_max_position_embeddings: must be positive, got "
                              f"{self.original_max_position_embeddings}")


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder whose FFNs are dense SwiGLU or STEM."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_query_groups: Optional[int] = None  # kv heads; None means as many as query heads
    untie_embeddings: bool = True
    rotary_base: float = 500000.0
    rope_scaling: Optional[RopeScalingConfig] = None  # None: plain RoPE
    norm_eps: float = 1e-5
    # Initial dense weights (model/init.py). "megatron": N(0, init_std), the output
    # projections (attention out, FFN down) divided by sqrt(2 x num_layers). "truncated_fan_in":
    # the official STEM code's (lingua's), a normal truncated at +-3 std, std = hidden_size^-0.5
    # for every projection from the hidden state and for the embedding and output layer,
    # ffn_hidden_size^-0.5 for the down projection, no depth scaling; `init_std` unused.
    init: Literal["megatron", "truncated_fan_in"] = "megatron"
    init_std: float = 0.02
    stem_layers: StemPlacement = "none"
    # Embedding/output rows are padded to a multiple of this (Megatron's convention) so the
    # vocab splits evenly over TP ranks; STEM tables keep exactly `vocab_size` rows.
    make_vocab_size_divisible_by: int = 128

    RANGES: ClassVar[dict[str, Range]] = {
        "rotary_base": Range(above=0), "norm_eps": Range(above=0, high=1),
        "init_std": Range(above=0, high=10)}

    def validate(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                     "vocab_size", "seq_length", "make_vocab_size_divisible_by"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size: {self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}")
        if self.kv_heads <= 0 or self.num_attention_heads % self.kv_heads:
            raise ConfigError(
                f"num_query_groups: {self.kv_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}")
        if isinstance(self.stem_layers, list):
            bad = [i for i in self.stem_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ConfigError(
                    f"stem_layers: index {bad[0]} is out of range for num_layers="
                    f"{self.num_layers} (layers are numbered 0..{self.num_layers - 1})")
            if len(set(self.stem_layers)) != len(self.stem_layers):
                raise ConfigError(f"stem_layers: duplicate index in {self.stem_layers}")

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def stem_layer_indices(self) -> list[int]:
        """0-based indices of the STEM layers, sorted."""
        if isinstance(self.stem_layers, list):
            return sorted(self.stem_layers)
        if self.stem_layers == "none":
            return []
        return list(range(1, self.num_layers, _PLACEMENT_STRIDE[self.stem_layers]))

    @property
    def is_stem(self) -> bool:
        return bool(self.stem_layer_indices)


# ---------------------------------------------------------------------------------------
# Parallel layout
# ---------------------------------------------------------------------------------------


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    # "full": recompute each layer's activations in backward (megatron's uniform method);
    # "selective": only `recompute_modules` of each layer (docs/training.md, "Activation
    # recompute", says what each saves and costs).
    recompute: Literal["none", "selective", "full"] = "none"
    # With recompute: selective (megatron's --recompute-modules): "core_attn" attention's
    # softmax(QK^T)V, "mlp_act" the FFN's activation silu(gate) x up (or x the table's
    # rows), "mlp" the whole FFN.
    recompute_modules: list[Literal["core_attn", "mlp_act", "mlp"]] = field(
        default_factory=list)
    # Positions per chunk of the output layer and cross-entropy, which then never hold the
    # whole logits (model/loss.py; one more output-layer GEMM per token); 0: all positions
    # at once (megatron's path).
    loss_chunk_tokens: int = 0
    # Minutes a collective may wait for the slowest rank before the job fails (torch's
    # process-group timeout; NCCL's watchdog aborts then, TORCH_NCCL_ASYNC_ERROR_HANDLING).
    # Long enough for the slowest thing every rank waits for together: a checkpoint save
    # or load of the 1B model on slow storage, lm-eval in the loop; short enough that a
    # hung rank ends the job well before its time limit (docs/troubleshooting.md).
    timeout_minutes: int = 30

    RANGES: ClassVar[dict[str, Range]] = {
        "timeout_minutes": Range(low=1, high=24 * 60, why="minutes; a day at most")}

    def validate(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if (self.recompute == "selective") != bool(self.recompute_modules):
            raise ConfigError("recompute_modules: give them with recompute: selective (and "
                              f"only then), got recompute: {self.recompute} and "
                              f"{self.recompute_modules}")
        if len(set(self.recompute_modules)) != len(self.recompute_modules):
            raise ConfigError(f"recompute_modules: listed twice in {self.recompute_modules}")
        if {"mlp", "mlp_act"} <= set(self.recompute_modules):
            raise ConfigError("recompute_modules: mlp recomputes the whole FFN, its "
                              "activation (mlp_act) included: give one of them")
        if self.loss_chunk_tokens < 0:
            raise ConfigError(f"loss_chunk_tokens: must be >= 0 (0 = off), got "
                              f"{self.loss_chunk_tokens}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("sequence_parallel: needs tensor_parallel > 1")

    def check_model(self, model: ModelConfig) -> None:
        """Rules that tie the layout to the model shape."""
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        rules = [
            ("model.ffn_hidden_size", model.ffn_hidden_size, tp, "parallel.tensor_parallel"),
            ("model.num_attention_heads", model.num_attention_heads, tp,
             "parallel.tensor_parallel"),
            ("model.num_query_groups", model.kv_heads, tp, "parallel.tensor_parallel"),
            ("model.padded vocab", model.padded_vocab_size, tp, "parallel.tensor_parallel"),
            ("model.num_layers", model.num_layers, pp, "parallel.pipeline_parallel"),
        ]
        for name, value, divisor, by in rules:
            if value % divisor:
                raise ConfigError(f"{name}: {value} is not divisible by {by}={divisor}")


# ---------------------------------------------------------------------------------------
# Data, optimizers, training
# ---------------------------------------------------------------------------------------


@dataclass
class DataSource:
    """One source of a stage's training data: token files and their share of the samples."""

    # A `.bin/.idx` path prefix (without the extension) or a prefix-set folder, from
    # preprocess_data.py; a set's prefixes share `weight` by their tokens.
    prefix: str
    weight: float  # share of the stage's samples, relative to the other sources' weights
    # Where the text comes from (e.g. a Hugging Face dataset and subset), for the record.
    dataset: str = ""
    # The whole source's size as tokenized (0: not known): what bench/data_scale.py
    # predicts the data path's cost at.
    tokens: float = 0
    documents: float = 0

    def validate(self) -> None:
        if not self.prefix:
            raise ConfigError("prefix: must name the token files (a .bin/.idx prefix)")
        if self.weight <= 0:
            raise ConfigError(f"weight: must be positive, got {self.weight}")
        for name in ("tokens", "documents"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0: not known), got "
                                  f"{getattr(self, name)}")


@dataclass
class DataBlend:
    """A data recipe (`recipes/data/*.yaml`): the sources of one training stage and their
    weights, which a training recipe names as `data.blend`."""

    sources: list[DataSource]

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("sources: a data recipe needs at least one source")
        prefixes = [s.prefix for s in self.sources]
        for i, prefix in enumerate(prefixes):
            if prefix in prefixes[:i]:
                raise ConfigError(f"sources[{i}].prefix: {prefix} is listed twice")


def load_blend(path: str | Path) -> DataBlend:
    """A data recipe file, checked like a recipe; errors name the file and the field."""
    data = read_mapping(Path(path), "data recipe")
    try:
        return from_dict(DataBlend, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


@dataclass
class DataConfig:
    # `.bin/.idx` path prefixes (without the extension) or prefix-set folders (with a
    # manifest.json, docs/data.md), mixed by `weights`; without weights megatron samples
    # each prefix in proportion to its size (its samples), a set's prefixes included.
    prefixes: list[str] = field(default_factory=list)
    weights: Optional[list[float]] = None
    # Or a data recipe (recipes/data/*.yaml, a path from the working directory like every
    # path here): its sources and weights, read into `sources` when the recipe is loaded,
    # so a checkpoint's recipe.yaml keeps the blend it trained on.
    blend: Optional[str] = None
    sources: list[DataSource] = field(default_factory=list)
    split: str = "98,2,0"  # train, valid, test proportions of each prefix's documents
    tokenizer_type: Literal["sentencepiece", "huggingface"] = "sentencepiece"
    tokenizer_model: str = ""
    # The datasets' sample indices (data/sample_cache.py), shared by every run of the same
    # data, split, seed and sequence length; default `cache/` beside the first training
    # entry. Build it ahead of time with tools/build_data_cache.py.
    cache_dir: Optional[str] = None
    # Document masking, megatron's GPTDatasetConfig flags (off, as in Megatron-LM): samples
    # pack documents end to end, each closed by the tokenizer's EOD token. Restart RoPE
    # positions at 0 after each EOD; keep attention inside each document (model/documents.py);
    # leave out of the loss the prediction made at each EOD (the next document's first token).
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # Named validation sets, each one prefix or a list of them, read whole (no split) and
    # logged as valid/<name>/loss beside the split's valid/loss; a split with no valid
    # share ("100,0,0") leaves these only.
    validation: dict[str, Union[str, list[str]]] = field(default_factory=dict)

    def validate(self) -> None:
        if self.blend is not None and not self.sources:
            try:
                self.sources = load_blend(self.blend).sources
            except ConfigError as e:
                raise ConfigError(f"blend: {e}") from None
        if self.sources and (self.prefixes or self.weights is not None):
            raise ConfigError(f"prefixes: the data is given by data.blend ({self.blend}) too; "
                              "give one of them (data.blend=null to train on data.prefixes)")
        if self.weights is not None and len(self.weights) != len(self.prefixes):
            raise ConfigError(f"weights: {len(self.weights)} weights for "
                              f"{len(self.prefixes)} prefixes")
        parts = self.split.split(",")
        if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts):
            raise ConfigError(f"split: expected three numbers like '98,2,0', got {self.split!r}")
        for name, prefixes in self.validation.items():
            if not _SET_NAME.fullmatch(str(name)):
                raise ConfigError(f"validation.{name}: a set's name is letters, digits, "
                                  "'_', '-' or '.' (it names the set's TensorBoard tags)")
            if not prefixes:
                raise ConfigError(f"validation.{name}: no prefixes given")
        if not self.split_validates and not self.validation:
            raise ConfigError(f"split: {self.split!r} has no validation share and "
                              "data.validation names no sets: nothing to validate on")

    @property
    def split_validates(self) -> bool:
        """Whether `split` gives a share of the training prefixes' documents to validation."""
        return float(self.split.split(",")[1]) > 0

    @property
    def validation_sets(self) -> dict[str, list[str]]:
        """`validation` with every set as a list of prefixes."""
        return {name: [p] if isinstance(p, str) else list(p)
                for name, p in self.validation.items()}

    def training_blend(self) -> tuple[list[str], Optional[list[float]]]:
        """(prefixes, weights or None for equal ones) of the training data, from either form."""
        if self.sources:
            return [s.prefix for s in self.sources], [s.weight for s in self.sources]
        return list(self.prefixes), list(self.weights) if self.weights else None

    def field_of(self, index: int) -> str:
        """The recipe field that names prefix `index` of `training_blend()`, for errors."""
        if self.sources:
            return f"data.blend: {self.blend}: sources[{index}].prefix" if self.blend \
                else f"data.sources[{index}].prefix"
        return "data.prefixes"


_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class TableOptimizerConfig:
    """The STEM tables' own optimizer (tables/), `optimizer.tables`: AdamW
    with the backbone's betas, eps and schedule, at `optimizer.lr x lr_mult`."""

    update: Literal["dense", "lazy"] = "dense"
    lr_mult: float = 1.0
    weight_decay: float = 0.1
    # "deepspeed": DeepSpeed's CPU Adam kernel (JIT-built once); "torch": same math in torch.
    kernel: Literal["deepspeed", "torch"] = "deepspeed"
    # Where the tables' fp32 master and Adam moments live and Adam runs: "cpu" (DeepSpeed's
    # CPU Adam), or "accelerator" for tables whose sharded state fits beside the model
    # (the 350M recipes): no copies of gradients or rows between CPU and accelerator.
    device: Literal["cpu", "accelerator"] = "cpu"

    RANGES: ClassVar[dict[str, Range]] = {
        "lr_mult": Range(above=0, high=1e3, why="the tables' lr is optimizer.lr times this"),
        "weight_decay": Range(low=0, high=1)}


@dataclass
class OptimizerConfig:
    """AdamW for the dense (backbone) parameters, inside the DeepSpeed engine; `tables`: the
    STEM tables' own optimizer, outside it."""

    lr: float = 4e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr x min_lr_ratio
    warmup_steps: int = 2000
    # Linear warmup from lr 0 at step 1 (lingua's, the official STEM code's) rather than
    # from lr / warmup_steps (Megatron's): training/lr.py.
    warmup_from_zero: bool = False
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # the threshold of the global gradient norm; 0 = off
    # "joint": one norm over backbone and tables, both scaled by the same factor.
    # "separate": each clipped by its own global norm (the official STEM code's), so the
    # tables, whose norm is far smaller, are almost never scaled down (training/update.py).
    clip_tables: Literal["joint", "separate"] = "joint"
    # Weight decay on the RMSNorm gains too (the official STEM code's AdamW decays every
    # parameter); false: norms undecayed, as Megatron and Llama do.
    decay_norms: bool = False
    zero_stage: Literal[1, 2] = 1
    offload: bool = False  # ZeRO-Offload of the dense optimizer to CPU (DeepSpeed CPU Adam)
    tables: TableOptimizerConfig = field(default_factory=TableOptimizerConfig)

    RANGES: ClassVar[dict[str, Range]] = {
        # Generous: it catches an exponent that lost its minus (4e4 for 4e-4), and leaves
        # room for runs made to diverge on purpose (tests/training/test_guard.py).
        "lr": Range(above=0, high=1e3, why="Adam's step is about lr per weight: a "
                    "learning rate is far below 1"),
        "min_lr_ratio": Range(low=0, high=1, why="a fraction of lr"),
        "warmup_steps": Range(low=0),
        "weight_decay": Range(low=0, high=1, why="AdamW multiplies the weights by 1 - lr x "
                              "weight_decay each step"),
        "beta1": Range(low=0, high=0.999999), "beta2": Range(low=0, high=0.999999),
        "eps": Range(above=0, high=1),
        "clip_grad": Range(low=0)}


@dataclass
class TableStorageConfig:
    """Where the STEM tables and their optimizer state live, and when their update runs
    (tables/host_tables.py, tables/), `tables`."""

    # The optimizer's settings, which this section held until they moved (recipes and
    # checkpoints written before): a recipe naming one here is an error saying where it went.
    MOVED: ClassVar[dict[str, str]] = {
        "update": "optimizer.tables.update", "lr_mult": "optimizer.tables.lr_mult",
        "weight_decay": "optimizer.tables.weight_decay", "kernel": "optimizer.tables.kernel",
        "optimizer_device": "optimizer.tables.device"}

    # Where the tables live (tables/host_tables.py). "device": on the accelerator, one
    # replica per rank. "host": in CPU memory, one copy per node shared by its ranks; each
    # micro-batch's rows are gathered and copied to the accelerator one micro-batch ahead.
    placement: Literal["device", "host"] = "device"
    # Who keeps and updates the tables' fp32 master and Adam moments (docs/tables.md).
    # "sharded": each data-parallel rank 1/n of the rows (optimizer state and Adam work per
    # rank = total / n; gradients go to the rows' owners, updated rows come back).
    # "replicated": every rank (device placement) or every node's copy (host) all of it.
    partition: Literal["sharded", "replicated"] = "sharded"
    # "next_step": a step's table update finishes while the next step computes, the rows
    # that step reads first (same results, docs/tables.md); needs partition: sharded and
    # placement: device (config/table_layout.py). "none": after the last backward.
    overlap: Literal["none", "next_step"] = "none"
    # host: rows per table kept on the accelerator for the most frequent ids (LFU with
    # aging); 0 = no cache.
    cache_rows: int = 0
    # host: threads gathering rows into the staging buffer.
    gather_threads: int = 4
    # host: data-parallel ranks sharing one host copy (they split its optimizer work by
    # rows); 0 = all of a node's ranks of the same tensor-parallel slice.
    ranks_per_copy: int = 0

    def validate(self) -> None:
        for name in ("cache_rows", "ranks_per_copy"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.gather_threads < 1:
            raise ConfigError(f"gather_threads: must be >= 1, got {self.gather_threads}")
        if self.placement == "device":
            for name in ("cache_rows", "ranks_per_copy"):
                if getattr(self, name):
                    raise ConfigError(f"{name}: needs placement: host (device-resident "
                                      "tables have every row in place on every rank)")


def upgrade_saved_recipe(data: dict) -> dict:
    """A recipe as a checkpoint saved it, with the table optimizer's settings moved from
    `tables` to `optimizer.tables` if it was saved before they moved."""
    tables = data.get("tables") or {}
    for old, new in TableStorageConfig.MOVED.items():
        if old in tables:
            section, sub, leaf = new.split(".")
            data.setdefault(section, {}).setdefault(sub, {})[leaf] = tables.pop(old)
    return data


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 512
    steps: int = 1000
    seed: int = 1234
    dtype: Literal["bf16", "fp32"] = "bf16"
    log_interval: int = 10
    eval_interval: int = 500
    eval_iters: int = 10
    save_interval: int = 1000
    # Checkpoint files written in the background: a save blocks the step only while the
    # state is copied to host memory (megatron_stem/checkpoint/background.py, docs/checkpoints.md).
    async_save: bool = False
    keep_last: int = 3
    save_dir: str = "runs/default"
    # A checkpoint whose model weights (backbone and tables) start a new run: the previous
    # stage by its recipe or run folder (its last complete checkpoint, refused until that
    # stage has finished: checkpoint/checkpointer.py `stage_start`), an iter_N folder, or the
    # output of tools/from_hf.py.
    # Ignored once save_dir holds a checkpoint to resume. The new run keeps its own step
    # count, schedule, data, save_dir and logs; only the parameters' shapes must match.
    init_from: Optional[str] = None
    # With init_from: also start from its optimizer states (fp32 master weights and Adam
    # moments, the backbone's and the tables'), their Adam step count continued. False: a
    # fresh optimizer whose master copy is the checkpoint's weights in the training dtype.
    init_optimizer: bool = False
    # With init_from, the STEM tables: "keep" the checkpoint's, or "reinit" them as a fresh
    # run would (the official code's `init_ckpt_path` does). A STEM run from a dense
    # checkpoint always starts fresh tables (the dense up-projections are dropped).
    init_tables: Literal["keep", "reinit"] = "keep"
    # Peak dense bf16 FLOP/s of one accelerator, for MFU (H100/H200 SXM: 989e12).
    peak_flops: float = 989e12
    # Deterministic kernels on a GPU, for debugging a difference between two runs (every
    # kernel on a CPU is already): slower, and attention in SDPA's math kernel (docs/tables.md).
    deterministic: bool = False

    RANGES: ClassVar[dict[str, Range]] = {
        "global_batch_size": Range(high=2**24, why="sequences per step; the 1B recipe takes "
                                   "512"),
        "micro_batch_size": Range(high=2**24), "steps": Range(high=2**40),
        "keep_last": Range(low=0), "eval_iters": Range(low=0),
        "peak_flops": Range(above=0)}

    def validate(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "steps", "log_interval",
                     "eval_interval", "save_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"global_batch_size: {self.global_batch_size} is not a multiple "
                              f"of micro_batch_size={self.micro_batch_size}")
        if self.init_optimizer and not self.init_from:
            raise ConfigError("init_optimizer: needs train.init_from, the checkpoint whose "
                              "optimizer states to start from")
        if self.init_optimizer and self.init_tables == "reinit":
            raise ConfigError("init_tables: reinit starts fresh tables, which the "
                              "checkpoint's table optimizer states do not belong to; set "
                              "train.init_optimizer=false, or train.init_tables=keep")


@dataclass
class GuardConfig:
    """What a run does when a step is not finite or its loss spikes (training/guard.py),
    `guard`. A non-finite step is always skipped whole."""

    # Skipped steps in a row after which the run stops (latest rewound to the last
    # checkpoint saved before them, one error line, a non-zero exit: not requeued).
    max_skipped_steps: int = 10
    # A loss above this multiple of the median of the last `spike_window` steps' losses is
    # a spike: logged, and the checkpoint before it kept. 0: no spike detection.
    spike_factor: float = 2.0
    spike_window: int = 50
    stop_on_spike: bool = False  # a spike stops the run as too many skipped steps do

    def validate(self) -> None:
        for name in ("max_skipped_steps", "spike_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.spike_factor and self.spike_factor <= 1:
            raise ConfigError(f"spike_factor: must be above 1 (or 0: off), got "
                              f"{self.spike_factor}")


@dataclass
class ProfileConfig:
    """A window of steps traced by torch's profiler (training/profiling.py), `profile`."""

    start_step: int = 0  # the window's first step (steps count from 1); 0 = no trace
    steps: int = 3  # steps in the window
    ranks: list[int] = field(default_factory=lambda: [0])  # global ranks that trace
    # On a GPU, also the CUDA allocator's history over the window, saved as a snapshot
    # (pytorch.org/memory_viz); the trace then carries memory events too.
    memory_snapshot: bool = True
    record_shapes: bool = False  # input shapes of each op (a larger trace)
    with_stack: bool = False  # Python stacks of each op (a much larger trace)
    dir: Optional[str] = None  # default <train.save_dir>/profile

    def validate(self) -> None:
        if self.start_step < 0:
            raise ConfigError(f"start_step: must be >= 0 (0 = off), got {self.start_step}")
        if self.steps < 1:
            raise ConfigError(f"steps: must be >= 1, got {self.steps}")
        if self.start_step and not self.ranks:
            raise ConfigError("ranks: no rank traces; name at least one (e.g. [0])")

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1


@dataclass
class MetricsConfig:
    """Where the scalars logged to TensorBoard go too (training/metrics.py), `metrics`."""

    # Weights & Biases: a project name turns it on (rank 0 logs, the resolved recipe as the
    # run's config; a resumed run continues the same W&B run). WANDB_MODE=offline works.
    wandb_project: Optional[str] = None
    wandb_entity: Optional[str] = None  # a team; default: your W&B default entity
    wandb_name: Optional[str] = None  # the run's display name; default: save_dir's name


@dataclass
class LmEvalConfig:
    """lm-evaluation-harness on the live model every `interval` steps (evaluation/),
    `lm_eval`. Tasks scored by log-likelihood: multiple choice, loglikelihood, rolling."""

    interval: int = 0  # 0 = off
    tasks: list[str] = field(default_factory=list)  # task (or group) names
    include_path: Optional[str] = None  # a folder of task YAMLs, e.g. over local files
    num_fewshot: Optional[int] = None  # default: each task's own
    limit: Optional[float] = None  # documents per task (below 1: a fraction); default all
    batch_size: int = 8  # sequences per forward on each data-parallel rank

    def validate(self) -> None:
        for name in ("interval", "batch_size"):
            if getattr(self, name) < (0 if name == "interval" else 1):
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.interval and not self.tasks:
            raise ConfigError(f"tasks: none given to run every {self.interval} steps "
                              "(lm_eval.interval=0 turns it off)")
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"limit: must be positive, got {self.limit}")


@dataclass
class Recipe:
    """A whole recipe file: the model, its layout, and how to train it."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    tables: TableStorageConfig = field(default_factory=TableStorageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)

    def validate(self) -> None:
        self.parallel.check_model(self.model)
        if self.profile.start_step and self.profile.last_step > self.train.steps:
            raise ConfigError(f"profile.start_step: the window, steps {self.profile.start_step}"
                              f"-{self.profile.last_step}, ends after the last step "
                              f"(train.steps={self.train.steps})")
        tables = self.tables
        if tables.cache_rows > self.model.vocab_size:
            raise ConfigError(f"tables.cache_rows: {tables.cache_rows} rows exceed "
                              f"model.vocab_size={self.model.vocab_size}")
        TableLayout.of(self).validate()  # the rules across both table sections
