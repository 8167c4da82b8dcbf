"""A SentencePiece `.model` as a Hugging Face `tokenizer.json` that encodes and decodes
exactly as the sentencepiece library does.

Why not transformers' own paths: its `SentencePieceBackend` calls sentencepiece to encode
but decodes by joining pieces (byte-fallback pieces come out as `<0x0A>`, leading spaces
are stripped), and its Llama conversion assumes a BPE model with Llama's rules. Here the
model's own spec decides: BPE or unigram, byte fallback, the dummy prefix, the normalizer.

What sentencepiece never matches in text stays unmatched: control tokens (`<s>`, `</s>`)
and byte pieces get no BPE merge, and the export's tokenizer_config turns off matching
special tokens in text (`split_special_tokens`). User-defined symbols are matched, as
sentencepiece does, in the normalized text. `check_same` refuses a conversion that differs
on any of `PROBES`.

Exact for BPE models (what tools/train_tokenizer.py and Llama-2 write). A unigram model
decodes exactly, but `tokenizers`' Unigram can match every piece, so a text that spells a
control or byte piece (`</s>`, `<0x0A>`) may segment differently, as may rare near-ties
(2 of 3,156 GCIDE entries with a 1,000-piece model): their scores are only made the worst.
"""

from __future__ import annotations

from pathlib import Path

from megatron_stem.runtime.errors import UserError

SPACE = "▁"  # U+2581: sentencepiece's visible space
# Probes of `check_same`: the whitespace, bytes and scripts where conversions go wrong.
PROBES = ["alpha\nbeta 42 é", "  two  spaces\tand a tab ", " leading", "trailing  ",
          "naïve café — 東京 🚀 Ωmega ½", "\x00\x07\x1b[0m control\r\n", "<b>a</b> <tag>",
          "x" * 40 + " 1234567890", "", " ", "\n\n"]
_NORMAL, _UNKNOWN, _USER_DEFINED = 1, 2, 4  # SentencePiece.Type (3: control, 5: unused, 6: byte)
_UNIGRAM, _BPE, _WORD = 1, 2, 3  # TrainerSpec.model_type
_NEVER = -1e9  # unigram score of what sentencepiece never matches (control, byte, unused)
_UNK_MARK = "\ue000"


def convert(path: str | Path):
    """The `tokenizers.Tokenizer` equivalent of the SentencePiece model at `path`."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer

    path = Path(path)
    proto = sentencepiece_model_pb2.ModelProto.FromString(path.read_bytes())
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = next((piece for piece, _, t in pieces if t == _UNKNOWN), None)
    tok = Tokenizer(_model(path, proto.trainer_spec, pieces, unk))
    tok.normalizer = _normalizer(proto.normalizer_spec)
    tok.decoder = _decoder(unk, proto.trainer_spec.unk_surface,
                           proto.normalizer_spec.add_dummy_prefix)
    tok.add_tokens([AddedToken(piece, normalized=True, special=False)
                    for piece, _, t in pieces if t == _USER_DEFINED])
    return tok


def _model(path: Path, spec, pieces: list[tuple[str, float, int]], unk: str | None):
    from tokenizers import models

    if spec.model_type == _BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        return models.BPE(vocab, _bpe_merges(pieces), unk_token=unk,
                          byte_fallback=spec.byte_fallback, fuse_unk=True)
    if spec.model_type == _UNIGRAM:
        scores = [(piece, score if t in (_NORMAL, _USER_DEFINED) else _NEVER)
                  for piece, score, t in pieces]
        unk_id = next((i for i, (piece, _, _) in enumerate(pieces) if piece == unk), None)
        return models.Unigram(scores, unk_id=unk_id, byte_fallback=spec.byte_fallback)
    kind = "word" if spec.model_type == _WORD else "char"
    raise UserError(f"{path}: a SentencePiece {kind} model; the export converts BPE and "
                    "unigram models only")


def _normalizer(spec):
    """Text -> what the model segments: the model's own normalization rule (a precompiled
    character map), its whitespace rule, the dummy prefix, spaces made visible."""
    from tokenizers import Regex, normalizers

    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex("^ +| +$"), ""),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps)


def _decoder(unk: str | None, unk_surface: str, dummy_prefix: bool):
    """Pieces -> text as sentencepiece decodes: visible spaces back to spaces, byte pieces to
    their bytes, the dummy prefix's space dropped from the start, an unknown piece as its
    surface (" ⁇ "; stood in for by a private-use mark until the prefix is dropped, since
    the surface itself starts with a space that must stay)."""
    from tokenizers import decoders

    steps = [decoders.Replace(unk, _UNK_MARK)] if unk is not None else []
    steps += [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    if unk is not None:
        steps.append(decoders.Replace(_UNK_MARK, unk_surface))
    return decoders.Sequence(steps)


def _bpe_merges(pieces: list[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """Every split of every mergeable piece into two vocabulary pieces, best score first:
    sentencepiece merges the adjacent pair whose union scores best, and so does a BPE model
    whose merges are ranked by that score."""
    ids = {piece: i for i, (piece, _, t) in enumerate(pieces) if t in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for piece, score, t in pieces:
        if t != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[piece], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def check_same(path: str | Path, tokenizer) -> None:
    """A UserError unless `tokenizer` encodes and decodes the probes as sentencepiece does
    (a model whose rules the conversion does not reproduce is refused, not mis-exported)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    for text in PROBES:
        ids = sp.encode(text)
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if got != ids or tokenizer.decode(ids, skip_special_tokens=False) != sp.decode(ids):
            raise UserError(f"{path}: cannot convert this SentencePiece model to a tokenizer.json "
                            f"that tokenizes {text!r} as sentencepiece does")
