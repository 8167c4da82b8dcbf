"""Downstream evaluation of the live model: lm-evaluation-harness through `MegatronLM`
(`lm_eval_adapter.py`), run by the training loop every `lm_eval.interval` steps
(`in_loop.py`)."""
