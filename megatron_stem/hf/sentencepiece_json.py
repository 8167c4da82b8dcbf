"""A SentencePiece `.model` as a Hugging Face `tokenizer.json` that encodes and decodes
exactly as the sentencepiece library does.

Why not transformers' own paths: its `SentencePieceBackend` calls sentencepiece to encode
but decodes by joining pieces (byte-fallback pieces come out as `<0x0A>`, leading spaces
are stripped), and its Llama conversion assumes a BPE model with Llama's rules. Here the
model's own spec decides: BPE or unigram, byte fallback, the dummy prefix, the normalizer.

What sentencepiece never matches in text stays unmatchable: control tokens (`<s>`, `</s>`)
and byte pieces get no merge (BPE) or a score no segmentation picks (unigram); the
export's tokenizer_config turns off matching special tokens in text
(`split_special_tokens`). User-defined symbols are matched, as sentencepiece does, in the
normalized text.
"""

from __future__ import annotations

from pathlib import Path

from megatron_stem.errors import UserError

SPACE = "▁"  # U+2581: sentencepiece's visible space
# Probes of `check_same`: the whitespace, bytes and scripts where conversions go wrong.
PROBES = ["alpha\nbeta 42 é", "  two  spaces\tand a tab ", " leading", "trailing  ",
          "naïve café — 東京 🚀 Ωmega ½", "\x00\x07\x1b[0m control\r\n", "<b>a</b> <tag>",
          "x" * 40 + " 1234567890", "", " ", "\n\n"]
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BPE, _UNIGRAM = 2, 1
_NEVER = -1e9  # a unigram score no segmentation can prefer to byte fallback


def _proto(path: Path):
    from sentencepiece import sentencepiece_model_pb2

    return sentencepiece_model_pb2.ModelProto.FromString(path.read_bytes())


def convert(path: str | Path):
    """The `tokenizers.Tokenizer` equivalent of the SentencePiece model at `path`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

    path = Path(path)
    proto = _proto(path)
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    kind, spec = proto.trainer_spec.model_type, proto.normalizer_spec
    unk = next((i for i, (_, _, t) in enumerate(pieces) if t == _UNKNOWN), None)
    byte_fallback = proto.trainer_spec.byte_fallback
    if kind == _BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        model = models.BPE(vocab, _bpe_merges(pieces), unk_token=pieces[unk][0] if unk is not None
                           else None, byte_fallback=byte_fallback, fuse_unk=True)
    elif kind == _UNIGRAM:
        scores = [(piece, score if t in (_NORMAL, _USER_DEFINED) else _NEVER)
                  for piece, score, t in pieces]
        model = models.Unigram(scores, unk_id=unk, byte_fallback=byte_fallback)
    else:
        raise UserError(f"{path}: a SentencePiece {'word' if kind == 3 else 'char'} model; the "
                        "export converts BPE and unigram models only")
    tok = Tokenizer(model)
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else []))
    tok.add_tokens([AddedToken(piece, normalized=True, special=False)
                    for piece, _, t in pieces if t == _USER_DEFINED])
    return tok


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
