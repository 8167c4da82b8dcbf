"""lm-eval in the loop: `MegatronLM` (evaluation/lm_eval_adapter.py) scores what one plain
forward of each request gives, however it batches, pads and truncates (the export and
lm-eval give the same scores: the trainer's run in test_training_instruments.py), and the
section's mistakes are one line before training starts (evaluation/in_loop.py)."""

import pytest
import torch
from lm_eval.api.instance import Instance

from support.lm_eval_tasks import write_local_lm_eval_tasks
from megatron_stem.config import ParallelConfig, Recipe, from_dict
from megatron_stem.runtime.errors import ConfigError
from megatron_stem.evaluation.in_loop import DownstreamEval
from megatron_stem.evaluation.lm_eval_adapter import MegatronLM
from megatron_stem.model import build_model
from megatron_stem.data.tokenizer import load_tokenizer
from workers.common import TINY, tiny_model

SEQ = 32


@pytest.fixture(scope="module")
def lm(world1, sp_model):
    config = tiny_model(vocab_size=1000, seq_length=SEQ)
    model = build_model(config, ParallelConfig()).eval()
    tokenizer = load_tokenizer("sentencepiece", sp_model)
    return MegatronLM(model, tokenizer, config.vocab_size, SEQ, batch_size=3)


def one_forward(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log p(continuation | context) from one unpadded forward of the last SEQ tokens."""
    tokens = (context + continuation)[-(SEQ + 1):]
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]), None, None)[0, :, :1000]
    logprobs = logits.float().log_softmax(-1)[-len(continuation):]
    target = torch.tensor(continuation)
    return (logprobs[torch.arange(len(target)), target].sum().item(),
            bool((logprobs.argmax(-1) == target).all()))


def test_scores_equal_one_plain_forward_per_request(lm):
    g = torch.Generator().manual_seed(0)
    requests = []
    for context_len, continuation_len in [(5, 1), (3, 4), (12, 2), (1, 1), (40, 3), (7, 7), (2, 9)]:
        ids = torch.randint(0, 1000, (context_len + continuation_len,), generator=g).tolist()
        requests.append((None, ids[:context_len], ids[context_len:]))
    # The model's own greedy continuation, so that `is_greedy` is seen true too.
    context = requests[0][1]
    with torch.no_grad():
        best = int(lm.model(torch.tensor([context]), None, None)[0, -1, :1000].argmax())
    requests.append((None, context, [best]))
    scores = lm._loglikelihood_tokens(requests)  # batches of 3, longest first, padded
    for (_, context, continuation), (logprob, is_greedy) in zip(requests, scores):
        expected, expected_greedy = one_forward(lm.model, context, continuation)
        assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-5)
        assert is_greedy == expected_greedy
    assert scores[-1][1] is True


def test_text_requests_follow_lm_eval_encoding(lm):
    """Text in: an empty context is the BOS token; a context's trailing space moves to
    the continuation (lm-eval's TemplateLM rules, as its HF model)."""
    tok = lm.tokenizer
    mc = lm.loglikelihood([Instance("loglikelihood", {}, ("the word ", "of a thing"), 0),
                           Instance("loglikelihood", {}, ("", "alpha beta"), 1)])
    whole = tok.encode("the word of a thing")
    context = tok.encode("the word")
    assert mc[0] == pytest.approx(one_forward(lm.model, context, whole[len(context):]))
    assert mc[1] == pytest.approx(one_forward(lm.model, [tok.bos], tok.encode("alpha beta")))
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {},
                                                    ("alpha beta gamma",), 0)])
    ids = tok.encode("alpha beta gamma")
    assert rolling == pytest.approx(one_forward(lm.model, [tok.bos], ids)[0])
    with pytest.raises(NotImplementedError, match="scores log-likelihoods only"):
        lm.generate_until([])


GENERATION_TASK = """\
task: my_local_generation
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: exact_match}]
"""


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    """The local tasks, and a generation task beside them."""
    tasks = write_local_lm_eval_tasks(tmp_path_factory.mktemp("lm_eval") / "tasks")
    (tasks / "my_local_generation.yaml").write_text(
        GENERATION_TASK.replace("DATA", str(tasks / "data.jsonl")))
    return tasks


@pytest.mark.parametrize("section, message", [
    ({"tasks": ["my_local_tsak"]}, "lm_eval.tasks: unknown task 'my_local_tsak' (did you mean "
                                   "'my_local_task'?)"),
    ({"tasks": ["no_such_thing_at_all"]}, "lm_eval.tasks: unknown task 'no_such_thing_at_all' "
                                          "(a local task's YAML goes in lm_eval.include_path)"),
    ({"tasks": ["my_local_generation"]}, "lm_eval.tasks: my_local_generation is a "
                                         "generate_until task; in-loop evaluation scores "
                                         "log-likelihoods only: generation (generate_until) is "
                                         "not implemented; evaluate generation tasks on an "
                                         "export"),
    ({"tasks": ["my_local_task"], "include_path": "/nonexistent"},
     "lm_eval.include_path: /nonexistent is not a folder"),
])
def test_the_tasks_are_checked_before_training_starts(world1, sp_model, local_tasks, section,
                                                      message, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = local_tasks
    recipe = from_dict(Recipe, {"model": {**TINY, "vocab_size": 1000},
                                "lm_eval": {"interval": 10, "include_path": str(tasks),
                                            **section}})
    tokenizer = load_tokenizer("sentencepiece", sp_model)
    with pytest.raises(ConfigError) as e:
        DownstreamEval.start(recipe, tokenizer)
    assert str(e.value) == message
    recipe.lm_eval.tasks = ["my_local_task", "my_local_perplexity"]
    recipe.lm_eval.include_path = str(tasks)
    assert DownstreamEval.start(recipe, tokenizer).due(20, 25)
    recipe.lm_eval.interval = 0
    assert DownstreamEval.start(recipe, tokenizer) is None
