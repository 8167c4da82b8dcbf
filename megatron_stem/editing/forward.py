"""Batched forwards under edits: next-token distributions, answer scores, greedy decoding.

Sequences of different lengths are right-padded into one batch: attention is causal, so
padding after a sequence never changes its positions, and each result is read at the
sequence's own positions. Remaps apply at inference time through `stem_ids`; rows
written by injections or baked remaps are applied by the caller (`inject.written`).

An averaged row (strategy `average`) is not a row of any table. For the forward it is
written into the rows of a token id that occurs nowhere in the batch, which therefore no
position reads but the remapped ones, and restored right after: the model is unchanged
when the call returns.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_stem.editing.inject import RowWrite, written
from megatron_stem.editing.remap import StemIds, TokenRemap, build_stem_ids
from megatron_stem.runtime.errors import UserError

BATCH = 64  # sequences per forward

RemapsPerRow = Optional[Sequence[Sequence[TokenRemap]]]


def pad_batch(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(s) for s in seqs]
    batch = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return batch, lengths


def _scratch_rows(backend, batch: torch.Tensor, stem: StemIds):
    """Placeholder ids of averaged rows -> free token ids, and the rows to write there."""
    vocab = backend.config.vocab_size
    ids = stem.ids.clone()
    used = set(batch.unique().tolist()) | set(ids[ids < vocab].unique().tolist())
    free = (i for i in range(vocab - 1, -1, -1) if i not in used)
    writes = []
    for placeholder, sources in stem.averages.items():
        scratch = next(free, None)
        if scratch is None:
            raise UserError("no token id is free in this batch to hold an averaged row")
        for layer in backend.stem_layers:
            where = ids[layer] == placeholder
            if where.any():
                writes.append(RowWrite(layer, scratch,
                                       backend.read_rows(layer, sources).mean(0), "average"))
                ids[layer][where] = scratch
    return ids, writes


def logits(backend, seqs: Sequence[Sequence[int]],
           remaps: RemapsPerRow = None) -> tuple[torch.Tensor, list[int]]:
    """Logits [b, s, vocab] of right-padded `seqs`, row r under remaps[r]; and the lengths."""
    batch, lengths = pad_batch(seqs)
    stem = None
    if remaps is not None and any(remaps):
        stem = build_stem_ids(batch, lengths, remaps, backend.config.num_layers,
                              backend.config.vocab_size)
    if stem is None or stem.ids is None:
        return backend.logits(batch), lengths
    ids, writes = _scratch_rows(backend, batch, stem) if stem.averages else (stem.ids, [])
    with written(backend, writes):
        return backend.logits(batch, ids), lengths


def _chunks(n: int):
    return (range(i, min(n, i + BATCH)) for i in range(0, n, BATCH))


def next_token_logprobs(backend, seqs: Sequence[Sequence[int]],
                        remaps: RemapsPerRow = None) -> torch.Tensor:
    """[len(seqs), vocab] log-probabilities of the token after each sequence."""
    out = []
    for rows in _chunks(len(seqs)):
        out_logits, lengths = logits(backend, [seqs[i] for i in rows],
                                     None if remaps is None else [remaps[i] for i in rows])
        last = torch.tensor(lengths) - 1
        out.append(out_logits[torch.arange(len(rows)), last].log_softmax(-1))
    return torch.cat(out)


def answer_scores(backend, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                  remaps: RemapsPerRow = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probability of each answer after its prompt [b], and whether
    greedy decoding would produce exactly the answer (every answer token is the argmax) [b].
    Remaps apply to the whole sequence, answer included, as they would while decoding."""
    seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
    logprob, greedy_ok = [], []
    for rows in _chunks(len(seqs)):
        out_logits, _ = logits(backend, [seqs[i] for i in rows],
                               None if remaps is None else [remaps[i] for i in rows])
        logp = out_logits.log_softmax(-1)
        for j, i in enumerate(rows):
            start, answer = len(prompts[i]), torch.as_tensor(list(answers[i]))
            steps = logp[j, start - 1:start - 1 + len(answer)]
            logprob.append(steps.gather(1, answer[:, None]).sum())
            greedy_ok.append(bool((steps.argmax(-1) == answer).all()))
    return torch.stack(logprob), torch.tensor(greedy_ok)


def greedy(backend, prompt: Sequence[int], max_new_tokens: int,
           remaps: Sequence[TokenRemap] = (), stop: Optional[int] = None) -> list[int]:
    """Greedy continuation (recomputing the whole sequence each step, as megatron has no
    KV cache here); remaps also reach generated tokens."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        token = int(next_token_logprobs(backend, [seq], [remaps])[0].argmax())
        seq.append(token)
        if token == stop:
            break
    return seq[len(prompt):]
