"""lm-evaluation-harness's model interface over the megatron model as it trains.

`MegatronLM` scores what lm-eval asks (`loglikelihood`, which multiple-choice tasks use,
and `loglikelihood_rolling`, for perplexity tasks) with the model in memory, at any
TP x DP layout and wherever the STEM tables live, without exporting anything. Generation
(`generate_until`) is not implemented: such tasks are refused before training starts
(`in_loop.py`); run them on an export (docs/export.md).

It gives the scores of `tools/to_hf.py` + `lm_eval --model hf` on the same checkpoint
(tested on CPU in fp32), because it follows the harness's HF model (`HFLM`) where that
decides a number: lm-eval's own `TemplateLM` encodes a (context, continuation) pair
(trailing spaces of the context go to the continuation; an empty context becomes the
prefix token, BOS or else EOS); an input is the last `seq_length + 1` tokens minus the
last; the log-softmax is over the real vocabulary (the export drops megatron's padding
rows); rolling windows come from lm-eval's `get_rolling_token_windows`. The log-softmax
is taken in float32 whatever the model's dtype.

Data parallel: every rank runs the harness on the same requests (lm-eval sees one rank,
`world_size` 1); each data-parallel rank scores a share of them (longest first, dealt
round-robin) and the shares are all-gathered over the data-parallel group, so every rank
returns every score. Tensor-parallel peers score the same share together; their vocab
slices of the logits are gathered before the softmax. Host-resident tables get each
batch staged before its forward (tables/host_tables.py), as validation does.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_stem.runtime.parallel import device

GENERATION_UNSUPPORTED = ("scores log-likelihoods only: generation (generate_until) is not "
                          "implemented; evaluate generation tasks on an export")


class MegatronLM(TemplateLM):
    """`model`: the megatron GPT model (a DeepSpeed engine's module); `tokenizer`: ours
    (megatron_stem.data.tokenizer); `vocab_size`: the real vocabulary; `max_length`: the
    model's sequence length; `tables`: the TableOptimizer when tables may live on the
    host (None: device-resident tables); `batch_size`: sequences per forward."""

    def __init__(self, model, tokenizer, vocab_size: int, max_length: int,
                 batch_size: int = 8, tables=None):
        super().__init__()
        if tokenizer.eod is None:
            raise ValueError("lm-eval needs an end-of-text token; the tokenizer has none")
        self.model, self.tokenizer, self.tables = model, tokenizer, tables
        self.vocab_size, self.max_length, self.batch_size = vocab_size, max_length, batch_size
        self.parallel = dist.is_initialized() and ps.model_parallel_is_initialized()
        self.tp = ps.get_tensor_model_parallel_world_size() if self.parallel else 1
        self.dp = ps.get_data_parallel_world_size() if self.parallel else 1
        self.dp_rank = ps.get_data_parallel_rank() if self.parallel else 0

    # -- what lm-eval's TemplateLM needs ---------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def prefix_token_id(self) -> int:
        """What an empty context becomes: BOS, else EOS (as the harness's HF model)."""
        return self.tokenizer.bos if self.tokenizer.bos is not None else self.tokenizer.eod

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)  # never adds special tokens, as the export's

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=True)  # a bar in a training log

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """[(log p(continuation | context), continuation is the greedy decode)] for
        requests ((context, continuation) text, context ids, continuation ids)."""
        items = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1):]
            items.append((whole[:-1], continuation))
        return self._scored_over_dp(items)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in disjoint windows of the model's length."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(utils.make_disjoint_window,
                                             utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length,
                                                 context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(f"MegatronLM {GENERATION_UNSUPPORTED}")

    # -- scoring ----------------------------------------------------------------------------

    def _scored_over_dp(self, items: list[tuple[list[int], list[int]]]):
        longest_first = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
        mine = longest_first[self.dp_rank::self.dp]
        scores = {}
        for at in range(0, len(mine), self.batch_size):
            batch = mine[at:at + self.batch_size]
            scores.update(zip(batch, self._score_batch([items[i] for i in batch])))
        if self.dp > 1:
            shares = [None] * self.dp
            dist.all_gather_object(shares, (_fingerprint(items), scores),
                                   group=ps.get_data_parallel_group())
            if len({fingerprint for fingerprint, _ in shares}) != 1:
                raise RuntimeError("lm-eval built different requests on different ranks "
                                   "(a task whose prompts are not deterministic)")
            scores = {i: s for _, share in shares for i, s in share.items()}
        return [scores[i] for i in range(len(items))]

    @torch.no_grad()
    def _score_batch(self, items: list[tuple[list[int], list[int]]]):
        # Right padding leaves a causal model's logits of the real positions unchanged; a
        # multiple of TP, which sequence parallelism splits the sequence by.
        length = -(-max(len(inp) for inp, _ in items) // self.tp) * self.tp
        tokens = torch.zeros(len(items), length, dtype=torch.long)
        for row, (inp, _) in enumerate(items):
            tokens[row, :len(inp)] = torch.tensor(inp)
        tokens = tokens.to(device())
        if self.tables is not None:
            self.tables.stage([{"tokens": tokens}], requires_grad=False)
        logits = self.model(tokens, None, None)  # [b, s, vocab / TP]
        if self.tp > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        out = []
        for row, (inp, continuation) in enumerate(items):
            n = len(inp)
            logprobs = logits[row, n - len(continuation):n, :self.vocab_size].float() \
                .log_softmax(-1)
            target = torch.tensor(continuation, device=logprobs.device)
            picked = logprobs.gather(1, target[:, None]).squeeze(1)
            out.append((float(picked.sum()), bool((logprobs.argmax(-1) == target).all())))
        return out


def _fingerprint(items) -> int:
    """A checksum of the requests' token ids (the same on every rank, or scores mix up)."""
    crc = 0
    for inp, continuation in items:
        crc = zlib.crc32(torch.tensor(inp + [-1] + continuation).numpy().tobytes(), crc)
    return crc
