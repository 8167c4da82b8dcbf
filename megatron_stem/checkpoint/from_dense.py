"""A STEM model started from its dense baseline's checkpoint: each STEM layer's gate and
down projections are the dense layer's gate half of `linear_fc1` and its `linear_fc2`; its
up half is dropped and the tables start fresh (`model_io.load_model`'s `dense_source`)."""

from __future__ import annotations

import re
from dataclasses import replace

STEM_MLP = re.compile(r"\.mlp\.linear_(gate|down)\.")


def from_dense_mlp(sh):
    """A STEM MLP's gate or down projection (weight or extra state) as the part of the
    dense MLP's checkpointed tensor it starts from. Megatron saves a SwiGLU `linear_fc1`
    as one [2 x ffn, hidden] tensor, the gate rows first (`apply_swiglu_sharded_factory`):
    a gate shard is the same rows of a tensor twice as tall."""
    key = sh.key.replace(".linear_gate.", ".linear_fc1.").replace(".linear_down.", ".linear_fc2.")
    if not sh.key.endswith("linear_gate.weight"):
        return replace(sh, key=key)
    axis = sh.prepend_axis_num
    shape, frags = list(sh.global_shape), list(sh.axis_fragmentations)
    shape[axis] *= 2
    frags[axis] *= 2
    return replace(sh, key=key, global_shape=tuple(shape), axis_fragmentations=tuple(frags))


def is_dense_source(saved_recipe, recipe) -> bool:
    """A dense checkpoint starting a STEM model (`load_model`'s `dense_source`)."""
    return recipe.model.is_stem and not saved_recipe.model.is_stem
