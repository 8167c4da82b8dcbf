"""Token ids of real text, read with the preprocessing readers (jsonl/txt/parquet, .gz/.zst,
files, globs, folders) up to a token budget, documents separated by end-of-document."""

from __future__ import annotations

from typing import Sequence

from megatron_stem.data.readers import Skip, find_shards, iter_records, read_chunks

_CHUNK_BYTES = 1 << 20


def read_token_ids(inputs: Sequence[str], tokenizer, max_tokens: int,
                   key: str = "text") -> list[int]:
    shards, _ = find_shards(inputs)
    ids: list[int] = []
    for shard in shards:
        for chunk in read_chunks(shard, [key], _CHUNK_BYTES):
            if isinstance(chunk, Skip):
                continue
            for record in iter_records(chunk, [key]):
                if isinstance(record, Skip):
                    continue
                ids += tokenizer.encode(record[0])
                if tokenizer.eod is not None:
                    ids.append(tokenizer.eod)
                if len(ids) >= max_tokens:
                    return ids[:max_tokens]
    return ids
