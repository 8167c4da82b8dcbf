"""What the trainer checks before it builds anything: the recipe asks for what this trainer
runs, the job's GPUs are visible to torch, the tokenizer fits the model. Each is a
one-line `UserError` naming the field or the fix; `--check` (preflight.py) runs the same
functions without starting a run."""

from __future__ import annotations

import os

import torch

from megatron_stem.config import Recipe
from megatron_stem.data.tokenizer import check_fits, load_setting
from megatron_stem.runtime.errors import ConfigError, UserError


def _gpus_given(environ) -> str | None:
    """`NAME=value` of the variable by which SLURM (or the user) gave this job GPUs."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = environ.get(name, "").strip()
        none = ("", "-1", "NoDevFiles") + (("0",) if name == "SLURM_GPUS_ON_NODE" else ())
        if value not in none:
            return f"{name}={value}"
    return None


def check_gpus_visible(environ=os.environ) -> None:
    """Refuse to start when the job was given GPUs but torch sees none: a CPU-only torch
    wheel on a GPU node would otherwise train on CPU with gloo, slowly and silently.
    `STEM_ALLOW_CPU=1` says a CPU run on such a node is meant (a test cluster whose GPUs
    are only scheduling tokens)."""
    given = _gpus_given(environ)
    if given is None or torch.cuda.is_available() or environ.get("STEM_ALLOW_CPU") == "1":
        return
    if torch.version.cuda is None and torch.version.hip is None:
        raise UserError(
            f"{given}: this job has GPUs but torch {torch.__version__} is a CPU-only build "
            "and sees none; install torch's CUDA build in this environment (pip install torch "
            "--index-url https://download.pytorch.org/whl/cu126, the CUDA version your driver "
            "supports), or set STEM_ALLOW_CPU=1 to train on CPU on purpose")
    raise UserError(
        f"{given}: this job has GPUs but torch {torch.__version__} (CUDA "
        f"{torch.version.cuda or torch.version.hip}) sees none: the GPU driver is missing or "
        "too old for this build (check nvidia-smi on the node)")


def use_deterministic_kernels() -> None:
    """`train.deterministic`: what makes two GPU runs give the same bits. cuBLAS's
    workspace must be fixed before its first call; SDPA's flash and memory-efficient
    backwards add with atomics, so attention takes the math kernel."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.cuda.is_available():
        for backend in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)


def check_trainable(recipe: Recipe) -> None:
    """Refuse what a recipe may describe but this trainer does not run."""
    if recipe.parallel.pipeline_parallel > 1:
        raise ConfigError("parallel.pipeline_parallel: training runs under the DeepSpeed "
                          "engine, which cannot pipeline a megatron model; use tensor "
                          "parallelism (checkpoints saved this way load at any PP)")


def load_tokenizer(recipe: Recipe):
    """The recipe's tokenizer, checked to fit the model's vocabulary."""
    tokenizer = load_setting("data.tokenizer_model", recipe.data.tokenizer_type,
                             recipe.data.tokenizer_model)
    check_fits(tokenizer, recipe.model.vocab_size,
               f"data.tokenizer_model: {recipe.data.tokenizer_model}")
    return tokenizer
