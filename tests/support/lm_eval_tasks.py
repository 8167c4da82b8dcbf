"""lm-evaluation-harness tasks over local files, and its CLI run offline: what the lm-eval
tests of the trainer, the export and the docs share."""

import subprocess
import sys
from pathlib import Path

from support.processes import ROOT, subprocess_env

LM_EVAL_DOCS = [{"question": f"the {w} of the {v}", "choices": ["stem table", "model token",
                                                                "alpha and beta"],
                 "answer": i % 3}
                for i, (w, v) in enumerate(zip(
                    ["alpha", "beta", "gamma", "delta", "stem", "word", "sense", "noun"],
                    ["dictionary", "verb", "plant", "water", "table", "light", "form", "act"]))]
# A perplexity task (lm-eval's rolling log-likelihood) over the same file.
ROLLING_TASK_YAML = """\
task: my_local_perplexity
dataset_path: json
dataset_kwargs: {data_files: {test: /data/my_task.jsonl}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{question}}"
metric_list:
  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}
"""


def write_local_lm_eval_tasks(folder: Path) -> Path:
    """`folder` with docs/export.md's local multiple-choice task (`my_local_task`,
    verbatim) and a rolling perplexity one (`my_local_perplexity`) over LM_EVAL_DOCS."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    docs = (ROOT / "docs" / "export.md").read_text()
    multiple_choice = docs.split("```yaml\n", 1)[1].split("```", 1)[0]
    for name, text in [("my_local_task", multiple_choice),
                       ("my_local_perplexity", ROLLING_TASK_YAML)]:
        (folder / f"{name}.yaml").write_text(text.replace("/data/my_task.jsonl", str(data)))
    return folder


def lm_eval_offline_env(tmp: Path) -> dict:
    """An environment in which lm-eval and the hub download nothing."""
    return subprocess_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                          HF_HOME=str(tmp / "hf_home"), PYTHONWARNINGS="ignore")


def run_lm_eval_cli(export: Path, tasks: Path, names: list[str], tmp: Path,
                    batch_size: int = 4) -> dict:
    """`lm_eval --model hf` (docs/export.md's command) on an export, over tasks `names`
    of the folder `tasks`, offline, on CPU; its results JSON."""
    import json

    out = tmp / "lm_eval_results"
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={export},trust_remote_code=True,stem_tables_on_cpu=True",
         "--include_path", str(tasks), "--tasks", ",".join(names), "--device", "cpu",
         "--batch_size", str(batch_size), "--output_path", str(out)],
        capture_output=True, text=True, timeout=300, env=lm_eval_offline_env(tmp), cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (results,) = out.rglob("results_*.json")
    return json.loads(results.read_text())
