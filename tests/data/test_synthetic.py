"""Synthetic tokens for a trial (data/synthetic.py): whole documents the trainer reads,
ids whose distinct count per step is the step planner's row model's."""

import numpy as np
import pytest

from megatron_stem.config import load_recipe
from megatron_stem.data import synthetic
from megatron_stem.data.indexed import bin_path, idx_path, read_header
from megatron_stem.planning import rows


def test_the_exponent_is_the_planner_s():
    assert synthetic.ZIPF_EXPONENT == rows.ZIPF_EXPONENT


def test_documents_end_with_the_eod_and_hold_ids_of_the_vocabulary(tmp_path):
    prefix = str(tmp_path / "syn")
    documents = synthetic.write_documents(prefix, 200_000, vocab=70_000, eod=2,
                                          document_tokens=500)
    header = read_header(idx_path(prefix))
    assert header.dtype == np.int32 and header.sequences == documents  # > 65,500 ids: int32
    tokens = np.fromfile(bin_path(prefix), dtype=np.int32)
    assert tokens.size == 200_000 and tokens[-1] == 2 and (tokens == 2).sum() == documents
    assert tokens.min() >= 0 and tokens.max() < 70_000
    assert 200_000 / documents == pytest.approx(501, rel=0.15)  # mean length + its eod


def test_distinct_ids_per_step_follow_the_planner_s_row_model(tmp_path):
    ids = synthetic.ZipfIds(128_256, exclude=None, rng=np.random.default_rng(0))
    for tokens in (8_192, 65_536, 524_288):  # a micro-batch, a rank's step, ~a node's
        distinct = len(np.unique(ids.draw(tokens)))
        assert distinct == pytest.approx(rows.expected_distinct(tokens, 128_256), rel=0.02)


def test_a_recipe_s_own_data_is_used_when_it_is_there(tmp_path, sp_model):
    prefix = str(tmp_path / "own")
    synthetic.write_documents(prefix, 10_000, vocab=1000, eod=2, document_tokens=100)
    tokenizer = [f"data.tokenizer_model={sp_model}", "data.tokenizer_type=sentencepiece",
                 "model.vocab_size=1024"]
    own = load_recipe("recipes/stem_1b.yaml", [f"data.prefixes=[{prefix}]", *tokenizer])
    assert synthetic.overrides_for(own, tmp_path / "out", 10_000, 100) == []
    missing = load_recipe("recipes/stem_1b_pretrain.yaml", tokenizer)  # its blend's files
    made = synthetic.overrides_for(missing, tmp_path / "out", 10_000, 100)
    assert made == ["data.blend=null", f"data.prefixes=[{tmp_path / 'out' / 'synthetic_1024'}]",
                    "data.tokenizer_type=sentencepiece", f"data.tokenizer_model={sp_model}"]
    tokens = np.fromfile(bin_path(str(tmp_path / "out" / "synthetic_1024")), dtype=np.uint16)
    assert tokens.size == 10_000 and tokens.max() < 1024
