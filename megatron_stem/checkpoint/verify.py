"""Whether a checkpoint is whole, safe to load and of this model: its COMPLETE marker, its
files' sizes and checksums (checksums.py), pickles that hold data only (unpickling.py), its
recipe readable and of the same parameter shapes. Each refusal is one line naming the
file."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_stem.checkpoint import checksums, unpickling
from megatron_stem.checkpoint.layout import COMPLETE, RECIPE, read_recipe
from megatron_stem.runtime.errors import UserError


def verify(ckpt: Path, recipe=None, contents: bool = True) -> None:
    """Refuse, in one line naming the file, a checkpoint that is not whole: no COMPLETE
    marker, a file missing, of another size, or (`contents`) of other contents than when it
    was saved or holding a pickle that would run code as it loads, an unreadable
    recipe.yaml, or (given `recipe`) one of another model shape. With `contents`, a
    collective under a process group: the checksums are shared over the ranks
    (`checksums.check_contents`), rank 0 reads the pickles (`unpickling.check`), and all
    refuse what any one found."""
    if not contents:
        _check_layout(ckpt, recipe)
        return
    entries = _agreed(lambda: _check_layout(ckpt, recipe))
    checksums.check_contents(ckpt, entries)
    _agreed(lambda: [unpickling.check(index.parent)
                     for index in sorted(ckpt.glob(f"*/{unpickling.METADATA}"))],
            rank0_only=True)


def _agreed(check, rank0_only: bool = False):
    """`check()` on every rank (or on rank 0 alone), what it refused raised on every rank
    (a collective under a process group); its result where it ran."""
    problem = result = None
    if not rank0_only or not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = check()
        except UserError as e:
            problem = str(e)
    problem = checksums.agreed(problem)
    if problem is not None:
        raise UserError(problem)
    return result


def _check_layout(ckpt: Path, recipe) -> dict[str, dict]:
    """`verify` without reading the files' contents; the marker's entries."""
    marker = ckpt / COMPLETE
    if not marker.is_file():
        raise UserError(f"{ckpt}: not a complete megatron-stem checkpoint (no {COMPLETE} marker;"
                        " an interrupted save, or not written by megatron-stem)")
    entries = checksums.read(marker)
    checksums.check_sizes(ckpt, entries)
    if not (ckpt / RECIPE).is_file():
        raise UserError(f"{ckpt}: not a megatron-stem checkpoint (no {RECIPE})")
    try:
        saved = read_recipe(ckpt)
    except Exception as e:  # any parse or schema error: the file is not what we wrote
        raise UserError(f"{ckpt / RECIPE}: unreadable ({str(e).splitlines()[0]})") from None
    if recipe is not None:
        check_same_shape(saved, recipe, ckpt)
    return entries


def parameter_shape(model) -> dict:
    """What decides the shapes (and the set) of a model's parameters, by recipe field:
    `seq_length`, `rotary_base`, `norm_eps` and `init_std` do not, so a run at another
    sequence length or RoPE base loads the same checkpoint."""
    return {"hidden_size": model.hidden_size, "num_layers": model.num_layers,
            "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.kv_heads, "ffn_hidden_size": model.ffn_hidden_size,
            "vocab_size": model.vocab_size,
            "make_vocab_size_divisible_by (padded vocab)": model.padded_vocab_size,
            "untie_embeddings": model.untie_embeddings,
            "stem_layers": model.stem_layer_indices}


def check_same_shape(saved_recipe, recipe, ckpt: Path, dense_source: bool = False) -> None:
    """A checkpoint whose parameters have other shapes is a user error, not a size-mismatch
    traceback (`parameter_shape`: the fields compared; the others may differ).
    `dense_source`: a STEM model from its dense baseline (`load_model`), the same shape
    but for the STEM layers."""
    saved, wanted = parameter_shape(saved_recipe.model), parameter_shape(recipe.model)
    if dense_source:
        del saved["stem_layers"], wanted["stem_layers"]
    diffs = [f"model.{k}: checkpoint {_shown(saved_recipe.model, k, saved[k])!r}, recipe "
             f"{_shown(recipe.model, k, wanted[k])!r}" for k in saved if saved[k] != wanted[k]]
    if diffs:
        what = "the dense baseline of another shape" if dense_source \
            else "checkpoint is of another model shape"
        raise UserError(f"{Path(ckpt) / RECIPE}: {what} ({'; '.join(diffs)})")


def _shown(model, key: str, value):
    """A compared value as the recipe gives it (a placement as written, not its layers)."""
    return model.stem_layers if key == "stem_layers" else value
