"""Prefix sets: a corpus as Megatron prefixes of a training-friendly size, and a manifest.

One folder per output, `<output-prefix>_<key>_document/`:

    GGGGG-IIIII.bin/.idx        prefix IIIII of group GGGGG (a SLURM array task; a run
                                without groups is group 00000)
    group-GGGGG-of-NNNNN.json   the group's prefixes: written once they are all durable,
                                they are usable from then on
    manifest.json               every group's prefixes in corpus order, written last

Both JSON files hold `format`, `dtype`, `tokenizer` (class, sha256, vocab_size),
`append_eod`, `documents`, `tokens` and `prefixes` ([{name, documents, tokens}], names
relative to the folder). The prefixes' documents, concatenated in that order, are those of
the one-file output (`--single-prefix`) byte for byte.

A prefix is a run of consecutive parts (the token files of one chunk of text), closed when
the next part would take it past a limit of tokens or documents: megatron-core 0.16 holds
document ids as int32, so no prefix may reach 2**31 documents, and files of tens of
billions of tokens are what filesystems and blending handle well. A part is never split.

Training reads a set through `resolve_blend`: a recipe's entry is a prefix or a set's
folder, a weighted set's weight is split over its prefixes by their tokens, and every
prefix is checked to exist and to fit megatron-core's int32 document ids before any rank
builds anything (a prefix of 2**31 documents or more would wrap to negative ids and read
out of bounds).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_stem.data.checks import check_token_files, max_token_id
from megatron_stem.data.indexed import (IndexHeader, bin_path, idx_path, index_size, merge,
                                        read_header)
from megatron_stem.runtime.durable import fsync_path, read_json, write_json
from megatron_stem.runtime.errors import UserError

FORMAT = 1
MANIFEST = "manifest.json"
DEFAULT_MAX_TOKENS = 20_000_000_000
DEFAULT_MAX_DOCUMENTS = 2 ** 30
# megatron-core 0.16 holds document ids as int32 (its dataset builders and GPTDataset).
MAX_DOCUMENTS = 2 ** 31 - 1
_PREFIX = re.compile(r"(\d{5})-(\d{5})")
_GROUP_FILE = re.compile(r"group-(\d{5})-of-(\d{5})\.json")


def prefix_name(group: int, index: int) -> str:
    return f"{group:05d}-{index:05d}"


def group_file(group: int, num_groups: int) -> str:
    return f"group-{group:05d}-of-{num_groups:05d}.json"


def contiguous_groups(sizes: Sequence[int], num_groups: int) -> list[range]:
    """Items (files in corpus order, of `sizes` bytes) as `num_groups` contiguous runs of
    about equal bytes: an item belongs to the group its middle byte falls in. Some groups
    are empty when there are fewer items than groups, or items of very unequal size."""
    weights = [s + 1 for s in sizes]  # +1: an empty file has a place too
    total, before, owner = sum(weights), 0, []
    for w in weights:
        owner.append(min((2 * before + w) * num_groups // (2 * total), num_groups - 1))
        before += w
    starts = [sum(1 for o in owner if o < g) for g in range(num_groups + 1)]
    return [range(starts[g], starts[g + 1]) for g in range(num_groups)]


@dataclass(frozen=True)
class Part:
    """One chunk's token files, one per key, and what they hold."""
    prefixes: dict  # key -> the part's path prefix
    documents: int
    tokens: dict  # key -> tokens


def plan(parts: Sequence[Part], max_tokens: int, max_documents: int) -> list[list[Part]]:
    """Consecutive parts grouped into prefixes, each closed when the next part would take
    it past `max_documents` or, for any key, `max_tokens` (so the keys' prefixes hold the
    same documents). A part over a limit is a prefix of its own; parts without documents
    are left out (megatron cannot read an empty prefix)."""
    prefixes, current, documents, tokens = [], [], 0, Counter()
    for part in parts:
        if part.documents == 0:
            continue
        over = documents + part.documents > max_documents or any(
            tokens[k] + n > max_tokens for k, n in part.tokens.items())
        if current and over:
            prefixes.append(current)
            current, documents, tokens = [], 0, Counter()
        current.append(part)
        documents += part.documents
        tokens.update(part.tokens)
    if current:
        prefixes.append(current)
    return prefixes


def _entry(name: str, parts: Sequence[Part], key: str) -> dict:
    return {"name": name, "documents": sum(p.documents for p in parts),
            "tokens": sum(p.tokens[key] for p in parts)}


def _whole(folder: str, entry: dict, dtype: type) -> bool:
    """The prefix's files are there with the sizes its counts imply."""
    prefix = os.path.join(folder, entry["name"])
    return (os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))
            and os.path.getsize(bin_path(prefix)) == entry["tokens"] * np.dtype(dtype).itemsize
            and os.path.getsize(idx_path(prefix)) == index_size(entry["documents"]))


def set_record(header: dict, prefixes: list[dict], **extra) -> dict:
    """A group file's or manifest's content: `header` (format, dtype, tokenizer,
    append_eod), the totals, the prefixes."""
    return {**header, "documents": sum(p["documents"] for p in prefixes),
            "tokens": sum(p["tokens"] for p in prefixes), "prefixes": prefixes, **extra}


@dataclass
class GroupWriter:
    """Writes one group's prefixes into each key's folder, resumably: after each prefix is
    durable (synced, renamed, folder synced) the count of finished prefixes goes to
    `progress_path`, so that a requeued task writes only the rest."""
    folders: dict  # key -> prefix-set folder
    group: int
    num_groups: int
    dtype: type
    identity: str  # of the group's inputs, settings and limits
    progress_path: str

    def done(self) -> Optional[dict]:
        """The group files (key -> record), when every key has one of this identity and
        the prefixes it lists are whole."""
        records = {k: read_json(os.path.join(f, group_file(self.group, self.num_groups)))
                   for k, f in self.folders.items()}
        if all(r is not None and r.get("identity") == self.identity
               and all(_whole(self.folders[k], p, self.dtype) for p in r["prefixes"])
               for k, r in records.items()):
            return records
        return None

    def write(self, prefixes: list[list[Part]], header: dict, stats: dict,
              release: Optional[Callable[[list[Part]], None]] = None) -> dict:
        """Write the prefixes not yet written, then the group files. `release(parts)` is
        called with each prefix's parts once the prefix is durable and recorded: they are
        not needed again (a task can remove them, so that its parts and its prefixes do not
        both fill the disk)."""
        names = [prefix_name(self.group, i) for i in range(len(prefixes))]
        entries = {k: [_entry(n, p, k) for n, p in zip(names, prefixes)] for k in self.folders}
        for folder in self.folders.values():
            os.makedirs(folder, exist_ok=True)
        for i in range(self.resumed(prefixes), len(prefixes)):
            for key, folder in self.folders.items():
                tmp = os.path.join(folder, f".tmp-{names[i]}")
                merge([p.prefixes[key] for p in prefixes[i]], tmp, self.dtype)
                os.replace(bin_path(tmp), bin_path(os.path.join(folder, names[i])))
                os.replace(idx_path(tmp), idx_path(os.path.join(folder, names[i])))
                fsync_path(folder)
            write_json(self.progress_path, {"identity": self.identity, "prefixes": i + 1})
            if release is not None:
                release(prefixes[i])
        records = {}
        for key, folder in self.folders.items():
            self._remove_stale(folder, len(prefixes))
            for entry in entries[key]:  # every id read once: the full check (data/checks.py)
                entry["max_token_id"] = max_token_id(os.path.join(folder, entry["name"]))
            records[key] = set_record(header, entries[key], group=[self.group, self.num_groups],
                                      identity=self.identity, stats=stats)
            write_json(os.path.join(folder, group_file(self.group, self.num_groups)),
                       records[key])
        if os.path.exists(self.progress_path):
            os.remove(self.progress_path)
        return records

    def resumed(self, prefixes: list[list[Part]]) -> int:
        """How many of these prefixes an earlier run of this group left whole."""
        progress = read_json(self.progress_path)
        if progress is None or progress["identity"] != self.identity:
            return 0
        count = 0
        while count < min(progress["prefixes"], len(prefixes)) and all(
                _whole(f, _entry(prefix_name(self.group, count), prefixes[count], k), self.dtype)
                for k, f in self.folders.items()):
            count += 1
        return count

    def _remove_stale(self, folder: str, count: int) -> None:
        """This group's prefixes beyond `count`, temporaries and group files of other array
        sizes, left by killed or earlier runs: a glob over the folder must not find them."""
        for name in os.listdir(folder):
            prefix = _PREFIX.fullmatch(name.removeprefix(".tmp-").split(".")[0])
            group = _GROUP_FILE.fullmatch(name)
            if ((prefix and int(prefix[1]) == self.group
                 and (name.startswith(".tmp-") or int(prefix[2]) >= count))
                    or (group and int(group[1]) == self.group
                        and int(group[2]) != self.num_groups)):
                os.remove(os.path.join(folder, name))


def array_sizes(folder: str) -> dict[int, float]:
    """The array sizes N of the group files in `folder`, with the newest file's time."""
    sizes = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = _GROUP_FILE.fullmatch(name)
        if match:
            mtime = os.path.getmtime(os.path.join(folder, name))
            sizes[int(match[2])] = max(sizes.get(int(match[2]), 0.0), mtime)
    return sizes


def remove_unlisted(folder: str, manifest: dict, num_groups: int) -> None:
    """Prefixes and group files in `folder` that the manifest does not list (from an earlier
    run of another array size)."""
    listed = {p["name"] for p in manifest["prefixes"]}
    for name in os.listdir(folder):
        stem = name.split(".")[0]
        group = _GROUP_FILE.fullmatch(name)
        if ((_PREFIX.fullmatch(stem) and name.endswith((".bin", ".idx")) and stem not in listed)
                or (group and int(group[2]) != num_groups)):
            os.remove(os.path.join(folder, name))


# -- reading a recipe's entries ---------------------------------------------------------


@dataclass(frozen=True)
class Prefix:
    path: str  # without .bin/.idx
    documents: int
    tokens: int  # a manifest's count, else the .bin's size over its token size
    max_token_id: Optional[int] = None  # a manifest's, read whole by preprocessing


def is_prefix_set(entry: str) -> bool:
    return os.path.isdir(entry)


def read_manifest(folder: str, field: str) -> list[Prefix]:
    """The prefixes of a prefix set, in corpus order; `field` names the recipe field."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        prefixes = [Prefix(os.path.join(folder, p["name"]), int(p["documents"]),
                           int(p["tokens"]), p.get("max_token_id"))
                    for p in manifest["prefixes"]]
    except FileNotFoundError:
        raise UserError(f"{field}: {folder} has no {MANIFEST}: preprocessing of this prefix "
                        "set has not finished (run its --merge-only step)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{field}: {path} is not a prefix-set manifest ({e})") from None
    if not prefixes:
        raise UserError(f"{field}: {path} lists no prefixes")
    return prefixes


def _single(prefix: str, field: str) -> tuple[Prefix, IndexHeader]:
    missing = [p for p in (bin_path(prefix), idx_path(prefix)) if not os.path.isfile(p)]
    if missing:
        raise UserError(f"{field}: {missing[0]} not found (give the path without .bin/.idx, "
                        "or a prefix-set folder, as written by preprocess_data.py)")
    try:
        header = read_header(idx_path(prefix))
    except UserError as e:
        raise UserError(f"{field}: {e}") from None
    return Prefix(prefix, header.sequences,
                  os.path.getsize(bin_path(prefix)) // np.dtype(header.dtype).itemsize), header


def resolve(entry: str, field: str, vocab_size: Optional[int] = None) -> list[Prefix]:
    """The prefixes of one data entry, each checked to exist, to fit megatron's ids (the
    count its `.idx` header gives) and to be whole (`checks.check_token_files`: sizes); with
    `vocab_size`, its ids too: a prefix set's every id (the largest, which its manifest
    records), else a sample."""
    in_set = is_prefix_set(entry)
    if not in_set:
        found = [_single(entry, field)]
    else:
        found = []
        for p in read_manifest(entry, field):
            single, header = _single(p.path, f"{field} ({entry}/{MANIFEST})")
            found.append((Prefix(p.path, single.documents, p.tokens, p.max_token_id), header))
    for prefix, header in found:
        check_documents(prefix, field, in_set)
        if vocab_size is not None and (prefix.max_token_id or -1) >= vocab_size:
            raise UserError(f"{field}: token id {prefix.max_token_id} in "
                            f"{bin_path(prefix.path)} is >= model.vocab_size {vocab_size} "
                            f"(the largest, from {entry}/{MANIFEST}): data made with another "
                            "tokenizer?")
        sample = vocab_size if prefix.max_token_id is None else None
        try:
            check_token_files(prefix.path, sample, header)
        except UserError as e:
            raise UserError(f"{field}: {e}") from None
    return [prefix for prefix, _ in found]


def check_documents(prefix: Prefix, field: str, in_set: bool = False) -> None:
    if prefix.documents > MAX_DOCUMENTS:
        remedy = ("preprocess it again with a lower --prefix-max-documents" if in_set else
                  "write the corpus as a prefix set instead (preprocess_data.py without "
                  "--single-prefix, --prefix-max-documents) and name its folder")
        raise UserError(
            f"{field}: {prefix.path} holds {prefix.documents:,} documents, more than "
            f"megatron-core's int32 document ids allow ({MAX_DOCUMENTS:,}); {remedy}")


def resolve_blend(entries: list[str], weights: Optional[list[float]],
                  field: Callable[[int], str], vocab_size: Optional[int] = None
                  ) -> tuple[list[Prefix], Optional[list[float]]]:
    """(prefixes, weights) of weighted entries, a set's weight split over its prefixes by
    their tokens. Without weights, megatron samples every prefix in proportion to its size
    (its samples), so a set needs no weights either."""
    prefixes, split = [], []
    for i, entry in enumerate(entries):
        resolved = resolve(entry, field(i), vocab_size)
        prefixes += resolved
        if weights is not None and len(resolved) == 1:
            split.append(weights[i])
        elif weights is not None:
            total = sum(p.tokens for p in resolved)
            split += [weights[i] * p.tokens / total for p in resolved]
    return prefixes, (split if weights is not None else None)
