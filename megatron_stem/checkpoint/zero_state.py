"""The dense parameters' optimizer states where DeepSpeed ZeRO-1/2 keeps them: each rank's
partition of the flattened fp32 masters and Adam moments, saved and loaded as the pieces of
the parameters' checkpoint tensors it covers, with no gather.

ZeRO flattens a parameter group into one buffer and gives data-parallel rank r the r-th
equal slice of it: one parameter's elements [start, stop) of its row-major flattening
(`param._hp_mapping.lp_fragment_address`), as views into the rank's fp32 partition and its
moments. A flat range of a row-major tensor is a few boxes (`flat_boxes`: a partial first
row, whole rows, a partial last row, recursively), each contiguous in memory, so the range
is saved as those boxes of the global tensor the parameter's own checkpoint entry
(`model.sharded_state_dict()`) places it in:

    optim/  optimizer.exp_avg.decoder.layers.0.mlp.linear_fc2.weight  [64, 128]
            rank 0: rows [0, 37) + row 37 [0, 51)     rank 1: row 37 [51, 128) + rows [38, 64)

The checkpoint holds the same global tensors as one saved at any other layout, so a load
asks for its own partition's boxes and reads them from whatever chunks were saved (another
DP size or TP layout, or a checkpoint written before this format, which saved each tensor
whole). Saving writes each rank's views as they are; loading reads into them in place.
megatron-core's `ShardedTensor` without `axis_fragmentations` (uneven sharding, written by
torch DCP with one chunk per box) carries them.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

import torch
from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

STATE_KEYS = ("fp32_param", "exp_avg", "exp_avg_sq")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes that cover elements [start, stop) of a row-major tensor of `shape`, in
    flat order; each box's elements are contiguous in that order (at most 2 x dims - 1)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))]
    inner = prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    head, tail = start - first * inner, stop - last * inner  # within the first, last row

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo, hi)]

    if first == last:
        return in_row(first, head, tail)
    boxes = []
    if head:
        boxes += in_row(first, head, inner)
        first += 1
    whole_end = last + 1 if tail == inner else last
    if whole_end > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if tail < inner:
        boxes += in_row(last, 0, tail)
    return boxes


def link_states(zero_optimizer) -> None:
    """Point every parameter at its slice of the optimizer states.

    DeepSpeed 0.19 links them once, right after the first param group's first step, when
    later groups (our no-weight-decay norms) have no state yet. Linking all groups again
    once every group has state gives each parameter its moments' fragments."""
    for i, _ in enumerate(zero_optimizer.optimizer.param_groups):
        lazy_init_hp_params_optimizer_state(zero_optimizer.bit16_groups[i],
                                            zero_optimizer.single_partition_of_fp32_groups[i],
                                            zero_optimizer.optimizer.state)


def partition_state(params) -> dict[str, ShardedTensor]:
    """{unique name: sharded tensor} of this rank's ZeRO partition of every dense
    parameter's three states, views into the live fp32 partition and moments. `params`:
    (parameter, its checkpoint entry in `model.sharded_state_dict()`) pairs. The states
    must exist and be linked (`link_states`)."""
    out = {}
    for param, sharding in params:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # no element of this parameter in this rank's partition
            continue
        start = mapping.lp_fragment_address.start
        stop = start + mapping.lp_fragment_address.numel
        fragments = {"fp32_param": mapping.get_hp_fragment(),
                     **{k: mapping.get_hp_fragment(k) for k in STATE_KEYS[1:]}}
        for piece, first in _pieces(sharding):
            lo, hi = max(start, first), min(stop, first + prod(piece.local_shape))
            at = lo - start  # where the piece's part begins in the fragments
            for offsets, sizes in flat_boxes(piece.local_shape, lo - first, hi - first):
                numel = prod(sizes)
                for key, fragment in fragments.items():
                    box = _box(piece, f"optimizer.{key}", offsets, sizes,
                               fragment.narrow(0, at, numel))
                    out[f"{box.key}@{box.global_offset}"] = box
                at += numel
    return out


def _pieces(sharding: ShardedTensor | ShardedTensorFactory) -> list[tuple[ShardedTensor, int]]:
    """The checkpoint tensors a parameter is saved as, each with the flat position of its
    first element in the parameter: itself, or the parts a factory makes of it (a SwiGLU
    `linear_fc1` is its gate and up halves, in two places of one global tensor)."""
    if isinstance(sharding, ShardedTensor):
        return [(sharding, 0)]
    numel = prod(sharding.data.shape)
    # First on the meta device: parts the factory cuts as views of the parameter (megatron's
    # SwiGLU chunks) are contiguous ranges at their storage offsets, learnt at every save
    # and load without an index of every element (8 bytes each: 134 MB for a 1B fc1, and
    # as much again to check it). Other parts are checked element by element.
    flat = torch.arange(numel, device="meta")
    parts = _flat(replace(sharding, data=flat.view(sharding.data.shape)).build())
    if all(p.data._base is flat and p.data.is_contiguous() for p in parts):
        return [(p, p.data.storage_offset()) for p in parts]
    index = torch.arange(numel).view(sharding.data.shape)  # which element each one is
    pieces = []
    for piece in _flat(replace(sharding, data=index).build()):
        first = int(piece.data.flatten()[0])
        if not torch.equal(piece.data.flatten(), torch.arange(first, first + piece.data.numel())):
            raise NotImplementedError(f"{sharding.key}: its checkpoint factory splits it into "
                                      "parts that are not contiguous ranges of it")
        pieces.append((piece, first))
    return pieces


def _flat(built) -> list[ShardedTensor]:
    if isinstance(built, ShardedTensor):
        return [built]
    values = built.values() if isinstance(built, dict) else built
    return [t for v in values for t in _flat(v)]


def _box(piece: ShardedTensor, prefix: str, offsets, sizes, data: torch.Tensor) -> ShardedTensor:
    """Elements `offsets` + `sizes` of `piece` (its local coordinates) as a sharded tensor of
    its global one, held by this data-parallel rank alone."""
    lead = piece.prepend_axis_num  # axes of the global tensor the local one does not have
    shape = (1,) * lead + tuple(sizes)
    replica = piece.replica_id
    return ShardedTensor(
        key=f"{prefix}.{piece.key}", data=data.view(shape), dtype=data.dtype, local_shape=shape,
        global_shape=piece.global_shape,
        global_offset=(*piece.global_offset[:lead],
                       *(g + o for g, o in zip(piece.global_offset[lead:], offsets))),
        axis_fragmentations=None,  # uneven: each rank's boxes are its own
        replica_id=(*replica[:-1], 0) if isinstance(replica, tuple) else 0)
