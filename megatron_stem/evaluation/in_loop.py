"""lm-evaluation-harness every `lm_eval.interval` steps (and at the last step) on the live
model, its scores logged per task (`lm_eval/<task>/<metric>`).

Before training starts rank 0 checks the section: the tasks exist (under lm-eval's own
and `include_path`'s task YAMLs), they load (their data is fetched once, into the
datasets cache, before any other rank reads it), and each is scored by log-likelihood;
a mistake stops every rank with one line naming the field. The harness's global seeds
are left alone (the trainer's RNG state is not the harness's to reset); few-shot
sampling keeps lm-eval's own seed, so every evaluation sees the same prompts.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
from pathlib import Path

from megatron_stem.config import Recipe
from megatron_stem.runtime.errors import ConfigError
from megatron_stem.runtime.parallel import on_rank0

SCORED = ("loglikelihood", "multiple_choice", "loglikelihood_rolling")


class DownstreamEval:
    def __init__(self, recipe: Recipe, tokenizer):
        self.config, self.model_config = recipe.lm_eval, recipe.model
        self.tokenizer = tokenizer

    @classmethod
    def start(cls, recipe: Recipe, tokenizer) -> "DownstreamEval | None":
        """The in-loop evaluation `recipe` asks for (None: `lm_eval.interval` is 0),
        checked on every rank before training starts."""
        config = recipe.lm_eval
        if not config.interval:
            return None
        if importlib.util.find_spec("lm_eval") is None:
            raise ConfigError("lm_eval.tasks: in-loop evaluation needs the lm-eval package "
                              "(pip install -r requirements.txt)")
        if not callable(getattr(tokenizer, "encode", None)) or tokenizer.eod is None:
            raise ConfigError("lm_eval.tasks: in-loop evaluation needs a tokenizer that reads "
                              "text and has an end-of-text token (data.tokenizer_model)")
        if config.include_path and not Path(config.include_path).is_dir():
            raise ConfigError(f"lm_eval.include_path: {config.include_path} is not a folder")
        self = cls(recipe, tokenizer)
        with _no_dataset_bars():
            on_rank0(self._check_tasks)
        return self

    def due(self, step: int, last_step: int) -> bool:
        return step % self.config.interval == 0 or step == last_step

    def _check_tasks(self) -> None:
        manager = _task_manager(self.config.include_path)
        for name in self.config.tasks:
            if name not in manager.all_tasks:
                close = difflib.get_close_matches(name, manager.all_tasks, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else \
                    " (a local task's YAML goes in lm_eval.include_path)"
                raise ConfigError(f"lm_eval.tasks: unknown task '{name}'{hint}")
        try:
            loaded = manager.load(list(self.config.tasks))
        except Exception as e:  # noqa: BLE001 (a task's data or YAML, said in one line)
            raise ConfigError(f"lm_eval.tasks: {', '.join(self.config.tasks)} did not load: "
                              f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
        for name, task in loaded["tasks"].items():
            kind = task.get_config("output_type")
            if kind not in SCORED:
                from megatron_stem.evaluation.lm_eval_adapter import GENERATION_UNSUPPORTED

                raise ConfigError(f"lm_eval.tasks: {name} is a {kind} task; in-loop evaluation "
                                  f"{GENERATION_UNSUPPORTED}")

    def run(self, model, tables=None) -> dict[str, dict[str, float]]:
        """Evaluate every task on `model` (all ranks take part); {task: {metric: value}}
        on rank 0, {} on the others. `tables`: the TableOptimizer (its overlapped update
        finished first, host-resident rows staged for each batch)."""
        import lm_eval

        from megatron_stem.evaluation.lm_eval_adapter import MegatronLM

        if tables is not None:
            tables.finish()  # an overlapped update: every row in place
        lm = MegatronLM(model, self.tokenizer, self.model_config.vocab_size,
                        self.model_config.seq_length, self.config.batch_size, tables)
        limit = self.config.limit
        model.eval()
        try:
            with _no_dataset_bars():
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=list(self.config.tasks),
                    task_manager=_task_manager(self.config.include_path),
                    num_fewshot=self.config.num_fewshot,
                    limit=int(limit) if limit is not None and limit >= 1 else limit,
                    bootstrap_iters=0, log_samples=False, random_seed=None,
                    numpy_random_seed=None, torch_random_seed=None)
        finally:
            model.train()
        return scores(results) if results is not None else {}


@functools.lru_cache(maxsize=None)
def _task_manager(include_path: str | None):
    """lm-eval's index of its task YAMLs and `include_path`'s (seconds to build: once per
    process, at the first use on each rank)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


@contextlib.contextmanager
def _no_dataset_bars():
    """Hugging Face datasets' progress bars off while a task loads (a training log is no
    terminal), as they were afterwards."""
    import datasets

    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results: its metrics (`<metric>,<filter>`
    keys) that are numbers, no stderr; a filter other than `none` is kept in the name
    (`exact_match_flexible-extract`)."""
    out = {}
    for task, values in results["results"].items():
        picked = {}
        for key, value in values.items():
            metric, comma, filtered = key.partition(",")
            if not comma or "_stderr" in metric or isinstance(value, bool) or \
                    not isinstance(value, (int, float)):
                continue
            picked[metric if filtered == "none" else f"{metric}_{filtered}"] = float(value)
        if picked:
            out[task] = picked
    return out
