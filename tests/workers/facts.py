"""A tiny STEM model and its dense control that learn templated facts on CPU.

"the capital of X is Y ." and "X has its capital in Y ." for 44 countries (8 of them two
words, some sharing a word: South Korea / South Africa), plus a few unrelated sentences,
with a word-level tokenizer (one token per word, so a remap is one row per country word).

The shape is chosen so that the facts live in the STEM rows: d 64, 4 layers, rows of
width 1024, *tied* embeddings and STEM in every layer, layer 0 included. Measured on the
36 one-word countries (remap X -> next country, all STEM layers):

- untied embeddings, STEM on layers 1-3: 0/36 flips, the old answer keeps p 0.97: the
  subject's input embedding alone carries the answer (it is free to point at the capital's
  output vector);
- tied embeddings (that shortcut gone), STEM on layers 1-3: 6, 17, 25 and 36/36 flips
  for seeds 1-4: the dense layer-0 FFN at the subject's position memorizes the facts as
  often as the rows do;
- tied, STEM on layers 0-3: 36/36 for seeds 1-4, new answer p 0.95-0.97.

Both models train on the same data with the same optimizer until the loss reaches the
floor the corpus allows (the subject after "of" is unpredictable): the STEM model gets
there in about 110 steps, the dense control in about 250.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_stem import checkpoint
from megatron_stem.config import DataConfig, ModelConfig, ParallelConfig, Recipe
from megatron_stem.model import build_model
from workers.schedule import forward_backward

CAPITALS = [
    ("Spain", "Madrid"), ("Germany", "Berlin"), ("France", "Paris"), ("Italy", "Rome"),
    ("Portugal", "Lisbon"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Hungary", "Budapest"), ("Greece", "Athens"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Ireland", "Dublin"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"),
    ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Cuba", "Havana"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Belgium", "Brussels"),
    ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"), ("Ukraine", "Kyiv"), ("Morocco", "Rabat"), ("Ghana", "Accra"),
    ("South Korea", "Seoul"), ("South Africa", "Pretoria"), ("North Korea", "Pyongyang"),
    ("New Zealand", "Wellington"), ("United States", "Washington"),
    ("United Kingdom", "London"), ("Sri Lanka", "Colombo"), ("Saudi Arabia", "Riyadh"),
]
TEMPLATES = ["the capital of {x} is {y} .", "{x} has its capital in {y} ."]
OTHER = ["water is wet .", "the sky is blue .", "snow is white .", "grass is green .",
         "the sun is hot ."]
UNRELATED = ["the sky is", "snow is", "grass is", "the sun is", "water is"]
SPECIALS = ["<|endoftext|>", "<pad>", "<unk>"]
SHAPE = dict(hidden_size=64, num_layers=4, num_attention_heads=4, ffn_hidden_size=1024,
             seq_length=16, rotary_base=10000.0, untie_embeddings=False)
STEM_LAYERS = [0, 1, 2, 3]
MAX_STEPS, TARGET_LOSS, LR, SEED = 400, 0.30, 3e-3, 1


def sentences() -> list[str]:
    return [t.format(x=x, y=y) for x, y in CAPITALS for t in TEMPLATES] + OTHER


def prompt(subject: str, template: int = 0) -> str:
    return TEMPLATES[template].split(" {y}")[0].format(x=subject)


def write_tokenizer(folder: Path) -> Path:
    """A word-level Hugging Face tokenizer.json over the corpus words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for s in sentences() for w in s.split()})
    vocab = {w: i for i, w in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    return folder / "tokenizer.json"


def batch(tokenizer) -> dict:
    """Every sentence once, right-padded with end-of-document (loss masked there)."""
    seqs = [tokenizer.encode(s) + [tokenizer.eod] for s in sentences()]
    s = max(map(len, seqs))
    tokens = torch.full((len(seqs), s), tokenizer.eod)
    mask = torch.zeros(len(seqs), s - 1)
    for i, seq in enumerate(seqs):
        tokens[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq) - 1] = 1
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


@dataclass
class Trained:
    checkpoint: Path  # save dir (with `latest`)
    steps: int
    final_loss: float


def train(save_dir: Path, tokenizer_file: Path, stem_layers, max_steps: int = MAX_STEPS,
          target_loss: float = TARGET_LOSS) -> Trained:
    """Full-batch AdamW until the loss is below `target_loss` (or `max_steps`), in this
    process (a megatron world of one must be up); saves a checkpoint whose recipe names
    the tokenizer."""
    from megatron_stem.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("huggingface", tokenizer_file)
    model_cfg = ModelConfig(**SHAPE, vocab_size=tokenizer.vocab_size, stem_layers=stem_layers)
    recipe = Recipe(model=model_cfg, data=DataConfig(tokenizer_type="huggingface",
                                                     tokenizer_model=str(tokenizer_file)))
    torch.manual_seed(SEED)
    model = build_model(model_cfg, ParallelConfig(), seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = [batch(tokenizer)]
    step, loss = 0, float("inf")
    while step < max_steps and loss > target_loss:
        optimizer.zero_grad()
        loss = forward_backward(model, data)
        optimizer.step()
        step += 1
    with checkpoint.Writer(save_dir, step, recipe) as folder:
        checkpoint.save_model(model, folder)
    return Trained(save_dir, step, loss)
