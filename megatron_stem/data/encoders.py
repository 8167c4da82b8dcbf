"""Batch encoders for preprocessing: gigatoken, or the reference tokenizer libraries.

Both take a batch of documents (an Arrow string array, or a list of str) and give every
document's ids back to back plus the length of each, as numpy arrays: no Python list per
document on the fast path.

- `gigatoken` (Rust; loads SentencePiece BPE `.model` files with byte fallback and most
  Hugging Face `tokenizer.json` files) encodes at several times the speed of the
  reference libraries and releases the GIL, so preprocessing runs it on threads.
- `reference`: our `Tokenizer` (sentencepiece / tokenizers), the ground truth; the
  fallback for whatever gigatoken cannot load.

gigatoken's ids are checked, not assumed, to be the reference's: by the identity tests
(tests/data/test_preprocess_identity.py) and, in every run, on its first documents
(`first_difference`, `--verify-tokenizer`).
"""

from __future__ import annotations

import json
import os
import threading
from itertools import chain
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from megatron_stem.data.columns import string_buffers
from megatron_stem.data.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, Tokenizer
from megatron_stem.runtime.errors import UserError

BACKENDS = ("auto", "gigatoken", "reference")

Texts = Union[Sequence[str], "pyarrow.Array"]  # noqa: F821


class ReferenceEncoder:
    """Our `Tokenizer`, one thread per encoder (callers parallelize over processes)."""

    name = "reference"

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def encode(self, texts: Texts) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(texts, list):
            texts = texts.to_pylist()
        ids = self.tokenizer.encode_batch(texts)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(chain.from_iterable(ids), np.uint32, int(lengths.sum()))
        return flat, lengths


class GigatokenEncoder:
    """gigatoken on the calling thread (`parallel=False`): threads of preprocessing share
    one encoder and each run their own call, so the thread count is the user's `--workers`.

    gigatoken caches the pieces of every word it has seen, without a bound: on text of
    ever new words (measured: random words) the cache grows by several times the text's
    size, and a long run's memory with it. So once the process's resident memory has grown
    `cache_limit` bytes beyond what it was when the encoder was made, the encoder is
    loaded afresh from `tokenizer_json` (a tenth of a second) and the old one, cache and
    all, is freed when the calls running on it return. Only Linux tells the resident
    memory cheaply (/proc/self/statm); elsewhere the cache is left alone.
    """

    name = "gigatoken"

    def __init__(self, tokenizer_json: Union[str, bytes], cache_limit: int = 512 << 20):
        self.tokenizer_json = tokenizer_json
        self.tokenizer = self._load()
        self.cache_limit, self.reloads = cache_limit, 0
        self._lock = threading.Lock()
        self._baseline = _resident_bytes()

    def encode(self, texts: Texts) -> tuple[np.ndarray, np.ndarray]:
        batch = texts if isinstance(texts, list) else _awkward_strings(texts)
        layout = self.tokenizer.encode_batch(batch, parallel=False).layout
        offsets = np.asarray(layout.offsets)
        flat = np.asarray(layout.content.data)[offsets[0]:offsets[-1]]
        self._bound_cache()
        return flat, np.diff(offsets)

    def _bound_cache(self) -> None:
        if self._baseline is None or _resident_bytes() - self._baseline <= self.cache_limit:
            return
        with self._lock:  # one thread reloads; the others keep encoding meanwhile
            if _resident_bytes() - self._baseline > self.cache_limit:
                self.tokenizer = self._load()
                self.reloads += 1
                # What the process holds besides the cache (large inputs, other threads'
                # chunks) is the new baseline: it must not make every call reload.
                self._baseline = _resident_bytes()

    def _load(self):
        import gigatoken

        return gigatoken.Tokenizer.from_json(self.tokenizer_json)


def _resident_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _awkward_strings(array) -> "awkward.Array":  # noqa: F821
    """An Arrow string array as the awkward array of strings gigatoken reads, sharing
    the text buffer (only the offsets are widened to int64)."""
    import awkward as ak

    if array.null_count:
        raise ValueError("null texts cannot be encoded")
    offsets, chars = string_buffers(array)
    return ak.Array(ak.contents.ListOffsetArray(
        ak.index.Index64(offsets),
        ak.contents.NumpyArray(chars, parameters={"__array__": "char"}),
        parameters={"__array__": "string"}))


# --- loading -----------------------------------------------------------------------------


class Unsupported(Exception):
    """gigatoken cannot (or is not installed to) encode exactly like this tokenizer."""


def load_gigatoken(tokenizer: Tokenizer) -> GigatokenEncoder:
    """A gigatoken encoder that encodes like `tokenizer`, or `Unsupported` saying why.

    Made from the local file's contents, never from a name gigatoken might look up on the
    Hugging Face Hub.
    """
    try:
        import gigatoken  # noqa: F401
    except ImportError:
        raise Unsupported("the gigatoken package is not installed") from None
    try:
        if isinstance(tokenizer, SentencePieceTokenizer):
            return GigatokenEncoder(_sentencepiece_json(tokenizer))
        if isinstance(tokenizer, HuggingFaceTokenizer):
            return GigatokenEncoder(tokenizer.file.read_bytes())
    except Exception as e:  # gigatoken raises ValueError, or plain Exceptions from Rust
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise Unsupported(f"gigatoken cannot load {tokenizer.path} ({reason})") from None
    raise Unsupported(f"gigatoken does not read {type(tokenizer).__name__}s")


def _sentencepiece_json(tokenizer: SentencePieceTokenizer) -> str:
    """gigatoken's tokenizer.json for a SentencePiece model, with SentencePiece's meaning
    of control symbols restored.

    gigatoken converts a `.model` as Hugging Face does: control symbols (`<s>`, `</s>`)
    become added tokens, matched in the text. SentencePiece never matches them (a
    document that contains the characters "</s>" is split into ordinary pieces); only
    user-defined symbols are matched. So control, unknown and unused pieces are dropped
    from the added tokens, and no merge may build one of them.
    """
    import sentencepiece
    from gigatoken._load.sentencepiece import sentencepiece_to_tokenizer_json

    model = Path(tokenizer.path).read_bytes()
    sp = sentencepiece.SentencePieceProcessor(model_proto=model)
    config = json.loads(sentencepiece_to_tokenizer_json(model))
    inert = {sp.id_to_piece(i) for i in range(sp.vocab_size())
             if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)}
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] not in inert]
    bpe = config["model"]
    bpe["merges"] = [m for m in bpe["merges"] if "".join(m) not in inert]
    return json.dumps(config, ensure_ascii=False)


def load_encoder(tokenizer: Tokenizer, backend: str) -> tuple[object, Optional[str]]:
    """The encoder `backend` names for `tokenizer`, and a note when `auto` fell back to
    the reference library (why gigatoken is not used)."""
    if backend not in BACKENDS:
        raise UserError(f"--tokenizer-backend: expected one of {', '.join(BACKENDS)}, "
                        f"got {backend!r}")
    if backend == "reference":
        return ReferenceEncoder(tokenizer), None
    try:
        return load_gigatoken(tokenizer), None
    except Unsupported as e:
        if backend == "gigatoken":
            raise UserError(f"--tokenizer-backend gigatoken: {e}") from None
        return ReferenceEncoder(tokenizer), f"{e}; tokenizing with the reference library"


# --- verification ------------------------------------------------------------------------


def first_difference(encoder, reference: ReferenceEncoder,
                     texts: list[str]) -> Optional[tuple[int, int, list, list]]:
    """Where `encoder` and `reference` first disagree on `texts`:
    (document, token, a few of encoder's ids there, the reference's), or None."""
    ours, theirs = encoder.encode(texts), reference.encode(texts)
    if np.array_equal(ours[1], theirs[1]) and np.array_equal(ours[0], theirs[0]):
        return None
    starts = np.concatenate(([0], np.cumsum(ours[1])))
    their_starts = np.concatenate(([0], np.cumsum(theirs[1])))
    for doc in range(len(texts)):
        a = ours[0][starts[doc]:starts[doc + 1]]
        b = theirs[0][their_starts[doc]:their_starts[doc + 1]]
        if not np.array_equal(a, b):
            n = min(len(a), len(b))
            token = int(np.argmax(a[:n] != b[:n])) if np.any(a[:n] != b[:n]) else n
            return doc, token, a[token:token + 4].tolist(), b[token:token + 4].tolist()
    raise AssertionError("the encodings differ but no document does")
