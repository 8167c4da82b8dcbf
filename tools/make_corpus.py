"""Build the shipped corpus `data_corpus/gcide.jsonl.gz` from Debian's `dict-gcide` package.

    apt-get download dict-gcide && dpkg-deb -x dict-gcide_*.deb /tmp/gcide
    python tools/make_corpus.py --dictd /tmp/gcide/usr/share/dictd

GCIDE (the GNU Collaborative International Dictionary of English, GPL-2+) is real English
prose: definitions, etymologies and quotations from Webster's 1913 and WordNet. Each
dictionary entry becomes one JSONL document {"id", "headword", "text"}; every `--every`-th
entry (in dictionary order, so all letters are covered) is kept to stay at a few MB. The
output is byte-for-byte reproducible (fixed gzip header, no timestamps).
"""

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

# dictd's index encodes offsets and lengths in this base64 alphabet, most significant first.
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# Full-line source tags such as "[1913 Webster]" or "[WordNet 1.5 +PJC]": bookkeeping of the
# dictionary's editors, not text. Usage labels such as "[Obs.]" stay.
_SOURCE_TAG = re.compile(r"^\[[^\]]*(Webster|WordNet|PJC|Century|RDH|\bAS\b)[^\]]*\]$")
_PRONUNCIATION = re.compile(r"\\[^\\\n]+\\")  # \Al"lo*cate\ : the dictionary's respelling
_CROSS_REF = re.compile(r"\{([^{}]*)\}")  # {Allow} : a hyperlink to another entry


def _b64(s: str) -> int:
    value = 0
    for c in s:
        value = value * 64 + _B64.index(c)
    return value


def _decode(raw: bytes) -> str:
    # A handful of entries carry stray Windows-1252 bytes (curly quotes).
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


def clean(entry: str) -> str:
    """Dictionary markup -> plain paragraphs, one per line."""
    entry = _CROSS_REF.sub(r"\1", _PRONUNCIATION.sub("", entry))
    paragraphs = []
    for block in re.split(r"\n\s*\n", entry):
        lines = [ln.strip() for ln in block.splitlines()]
        words = " ".join(ln for ln in lines if ln and not _SOURCE_TAG.match(ln))
        words = re.sub(r"\s+", " ", words).replace(" ,", ",").strip()
        if words:
            paragraphs.append(words)
    return "\n".join(paragraphs)


def entries(dictd: Path):
    """(headword, text) of each distinct entry, in the order of the dictionary file."""
    index = dictd / "gcide.index"
    data = gzip.open(dictd / "gcide.dict.dz").read()  # dictzip is gzip with an extra header
    spans = {}
    for line in index.read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        if not headword.startswith("00-database"):
            spans.setdefault((_b64(offset), _b64(length)), headword)
    for (offset, length), headword in sorted(spans.items()):
        yield headword, clean(_decode(data[offset:offset + length]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dictd", required=True, type=Path,
                    help="folder with gcide.index and gcide.dict.dz")
    ap.add_argument("--every", type=int, default=4, help="keep every n-th entry")
    ap.add_argument("--output", type=Path, default=Path("data_corpus/gcide.jsonl.gz"))
    args = ap.parse_args(argv)
    for name in ("gcide.index", "gcide.dict.dz"):
        if not (args.dictd / name).is_file():
            sys.exit(f"error: --dictd {args.dictd}: no {name} there")

    kept = text_bytes = 0
    with open(args.output, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as out:
        for i, (headword, text) in enumerate(entries(args.dictd)):
            if i % args.every or not text:
                continue
            kept += 1
            text_bytes += len(text.encode())
            doc = {"id": f"gcide-{i:06d}", "headword": headword, "text": text}
            out.write(json.dumps(doc, ensure_ascii=False).encode() + b"\n")
    print(f"{args.output}: {kept} documents, {text_bytes / 1e6:.1f} MB of text, "
          f"{args.output.stat().st_size / 1e6:.1f} MB compressed")


if __name__ == "__main__":
    main()
