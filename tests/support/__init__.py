"""What the tests share: `processes` (paths, a child's environment, torchrun over
tests/workers/, results made once per run), `launcher` (the suite's torchrun, ranks forked
from a process that imported the libraries), `training_runs` (the trainer's toy data and
the checks of its curves and checkpoints), `slurm_cluster` (a real two-node SLURM cluster),
`wandb_records` (W&B's offline records), `lm_eval_tasks` (local lm-eval tasks, offline).
The scripts the ranks run are tests/workers/; data files are tests/fixtures/."""
