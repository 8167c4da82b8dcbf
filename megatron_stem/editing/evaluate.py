"""How well remapping edits facts, in numbers: success and locality.

Given facts (subject, prompt, answer), each edit remaps one fact's subject onto another
fact's subject (pairs i -> j; default each fact onto the next, cyclically) and asks:

- success: after the edit, greedy decoding of fact i's prompt produces fact j's answer
  (every answer token is the argmax, teacher-forced), and how much probability the new
  answer gains; also how often the old answer survives;
- locality: the next-token distributions of the other prompts (every fact whose subject is
  not the edited one, plus `unrelated` prompts) before and after, as KL(before || after),
  and how often their top-1 token is unchanged.

Each strategy is evaluated in each mode: `inference` (remapped lookups, weights
untouched) and `baked` (the rows written, `remap.bake_writes`). A pair a strategy cannot
express (one_to_one between names of different token counts) is counted as skipped. A
dense model runs through the same code: it has no STEM layers, so no remap reaches it.

Spec file (YAML or JSON):

    facts:
      - {subject: Spain, prompt: "The capital of Spain is", answer: " Madrid"}
    pairs: [[0, 1], ...]            # optional; default i -> i+1 (cyclic)
    strategies: [one_to_one]        # any of remap.py's
    modes: [inference, baked]
    layers: null                    # STEM layers to edit; default all
    unrelated: ["Water boils at"]   # more locality prompts
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from megatron_stem.config import from_dict
from megatron_stem.editing import forward
from megatron_stem.editing.inject import written
from megatron_stem.editing.remap import bake_writes, find_occurrences
from megatron_stem.editing.resolve import encode, resolve_remap
from megatron_stem.editing.spec import Remap, Strategy, Tokens, read_structured
from megatron_stem.runtime.errors import ConfigError, UserError

Mode = Literal["inference", "baked"]


@dataclass
class Fact:
    subject: Tokens
    prompt: Tokens
    answer: Tokens


@dataclass
class EvalSpec:
    facts: list[Fact]
    pairs: Optional[list[list[int]]] = None
    strategies: list[Strategy] = field(default_factory=lambda: ["one_to_one"])
    modes: list[Mode] = field(default_factory=lambda: ["inference"])
    layers: Optional[list[int]] = None
    unrelated: list[Tokens] = field(default_factory=list)

    def validate(self) -> None:
        if len(self.facts) < 2:
            raise ConfigError("facts: at least two facts are needed to edit one into another")
        for k, pair in enumerate(self.pairs or []):
            if len(pair) != 2 or not all(0 <= i < len(self.facts) for i in pair) \
                    or pair[0] == pair[1]:
                raise ConfigError(f"pairs[{k}]: expected [i, j], two different fact indices "
                                  f"below {len(self.facts)}, got {pair}")

    def edit_pairs(self) -> list[tuple[int, int]]:
        n = len(self.facts)
        return [tuple(p) for p in self.pairs] if self.pairs else [(i, (i + 1) % n)
                                                                  for i in range(n)]


def load_eval_spec(path: str | Path) -> EvalSpec:
    return from_dict(EvalSpec, read_structured(path), f"{path}: ")


@dataclass
class _Fact:
    subject: tuple[int, ...]
    prompt: tuple[int, ...]
    answer: tuple[int, ...]


def _kl(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """KL(before || after) of rows of log-probabilities."""
    return (before.exp() * (before - after)).sum(-1).clamp(min=0)


def evaluate(backend, tokenizer, spec: EvalSpec, where: str = "facts") -> dict:
    """The report (a JSON-able dict) of every (strategy, mode) of `spec` on `backend`."""
    vocab = backend.config.vocab_size
    facts = [_Fact(*(encode(tokenizer, getattr(f, k), vocab, f"{where}: facts[{i}].{k}")
                     for k in ("subject", "prompt", "answer")))
             for i, f in enumerate(spec.facts)]
    for i, f in enumerate(facts):
        if not find_occurrences(f.prompt, f.subject):
            raise UserError(f"{where}: facts[{i}].prompt: the subject's tokens {list(f.subject)} "
                            f"do not occur in the prompt's {list(f.prompt)}")
    unrelated = [encode(tokenizer, t, vocab, f"{where}: unrelated[{i}]")
                 for i, t in enumerate(spec.unrelated)]
    prompts = [f.prompt for f in facts]
    answers = [f.answer for f in facts]
    _, known = forward.answer_scores(backend, prompts, answers)
    locality_prompts = prompts + unrelated
    before = forward.next_token_logprobs(backend, locality_prompts)
    pairs = spec.edit_pairs()
    target_before, _ = forward.answer_scores(backend, [facts[i].prompt for i, _ in pairs],
                                             [facts[j].answer for _, j in pairs])
    report = {"model": str(backend.source), "kind": backend.kind,
              "stem_layers": backend.stem_layers, "facts": len(facts),
              "facts_known": int(known.sum()), "pairs": len(pairs), "results": []}
    for strategy in spec.strategies:
        for mode in spec.modes:
            report["results"].append(_evaluate_one(
                backend, tokenizer, facts, pairs, strategy, mode, spec.layers, locality_prompts,
                before, target_before, known, where))
    return report


def _evaluate_one(backend, tokenizer, facts, pairs, strategy, mode, layers, locality_prompts,
                  before, target_before, known, where) -> dict:
    per_edit, kls, unchanged = [], [], []
    for k, (i, j) in enumerate(pairs):
        source, target = facts[i], facts[j]
        try:
            remap = resolve_remap(Remap(source=list(source.subject), target=list(target.subject),
                                        strategy=strategy, layers=layers), tokenizer,
                                  backend.config, f"{where}: pairs[{k}]")
        except UserError:
            continue  # the strategy cannot express this pair (e.g. one_to_one, lengths differ)
        others = [p for p, f in enumerate(locality_prompts)
                  if p >= len(facts) or facts[p].subject != source.subject]
        if mode == "inference":
            writes, remaps = [], [remap]
        else:
            writes, remaps = bake_writes(backend, [remap]), []
        with written(backend, writes):
            logp, ok = forward.answer_scores(backend, [source.prompt] * 2,
                                             [target.answer, source.answer], [remaps] * 2)
            after = forward.next_token_logprobs(backend, [locality_prompts[p] for p in others],
                                                [remaps] * len(others))
        kl = _kl(before[others], after)
        kls.append(kl)
        unchanged.append(before[others].argmax(-1) == after.argmax(-1))
        per_edit.append({
            "source": i, "target": j, "success": bool(ok[0]), "old_answer_kept": bool(ok[1]),
            "both_known": bool(known[i] and known[j]),
            "p_target_before": float(target_before[k].exp()),
            "p_target_after": float(logp[0].exp()),
            "locality_kl_max": float(kl.max()) if len(kl) else 0.0})
    n = len(per_edit)
    kl_all = torch.cat(kls) if kls else torch.zeros(0)
    same = torch.cat(unchanged) if unchanged else torch.zeros(0, dtype=torch.bool)
    known_pairs = [e for e in per_edit if e["both_known"]]

    def mean(key, items=per_edit):
        return sum(float(e[key]) for e in items) / len(items) if items else 0.0
    return {
        "strategy": strategy, "mode": mode, "edits": n, "skipped": len(pairs) - n,
        "success": mean("success"), "success_count": sum(e["success"] for e in per_edit),
        "success_when_both_known": mean("success", known_pairs),
        "both_known": len(known_pairs),
        "old_answer_kept": mean("old_answer_kept"),
        "p_target_before": mean("p_target_before"), "p_target_after": mean("p_target_after"),
        "locality": {"prompts": int(kl_all.numel()),
                     "kl_mean": float(kl_all.mean()) if kl_all.numel() else 0.0,
                     "kl_max": float(kl_all.max()) if kl_all.numel() else 0.0,
                     "top1_unchanged": float(same.float().mean()) if same.numel() else 1.0},
        "per_edit": per_edit,
    }


def format_report(report: dict) -> str:
    """The report as a table, one line per (strategy, mode)."""
    lines = [f"{report['model']} ({report['kind']}, STEM layers {report['stem_layers'] or 'none'})"
             f": knows {report['facts_known']}/{report['facts']} facts, {report['pairs']} edits",
             f"{'strategy':<11} {'mode':<9} {'edits':>5} {'success':>9} {'old kept':>8} "
             f"{'p(new) before->after':>21} {'locality KL mean/max':>21} {'top-1 same':>10}"]
    for r in report["results"]:
        loc = r["locality"]
        lines.append(
            f"{r['strategy']:<11} {r['mode']:<9} {r['edits']:>5} "
            f"{r['success_count']:>4} {r['success']:>4.0%} {r['old_answer_kept']:>8.0%} "
            f"{r['p_target_before']:>10.3f} -> {r['p_target_after']:.3f} "
            f"{loc['kl_mean']:>10.2e} / {loc['kl_max']:.2e} {loc['top1_unchanged']:>10.1%}")
    return "\n".join(lines)
