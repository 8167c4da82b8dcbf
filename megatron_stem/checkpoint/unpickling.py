"""Reading a checkpoint's pickles without running code from it.

A dist checkpoint (`model/`, `optim/`) keeps its index in `.metadata`, a pickle that torch
reads with `pickle.load` (`FileSystemReader.read_metadata`); megatron-core keeps small
objects (a layer's `_extra_state`, 0.19's `common_state`) as pickles inside the shard
files, which torch loads with `torch.load(weights_only=False)`, and 0.16-0.18 their
common state in `common.pt`. Unpickling calls whatever functions the file names: a
checkpoint from a shared folder or a download could run any code as it loads.

`check(folder)` reads every one of them before megatron-core or torch does: `.metadata`
with an unpickler that builds only what a DCP index is made of (torch's checkpoint
metadata classes, sizes, dtypes, layouts, paths, plain containers: `ALLOWED`), the objects and
`common.pt` with torch's own allow-listed unpickler (`weights_only=True`). Anything else is
refused in one line naming the file. `verify.verify` runs it on every path that reads a
checkpoint (resume, `train.init_from`, tools/to_hf.py, editing, tools/verify_checkpoint.py),
so the loaders that follow read proven files; the project's own reader of a dist checkpoint
(`streaming.CheckpointReader`) reads `.metadata` through `SafeFileSystemReader` as well.
(`train_state.pt` is read with `weights_only=True` by `train_state.load_train_state`.)
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from megatron_stem.runtime.errors import UserError

METADATA = ".metadata"
COMMON = "common.pt"
UNSUPPORTED = re.compile(r"GLOBAL (\S+)")  # the global torch's weights_only unpickler refused

# What a DCP index is made of (torch 2.13-2.15, as megatron-core 0.16.1-0.19 write it).
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # where torch before 2.1 kept these two
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties",
                                                         "MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    # torch's own writer records the folder it wrote as a path (`StorageMeta.checkpoint_id`)
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                "PureWindowsPath"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Builds the classes of `ALLOWED` and torch's dtypes, layouts and memory formats;
    refuses any other global."""

    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(path: Path) -> Metadata:
    """A dist checkpoint's index (`.metadata`), built from allow-listed classes only; one
    holding anything else is refused in one line."""
    try:
        with open(path, "rb") as f:
            metadata = _IndexUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise _refused(path, str(e)) from None
    except Exception as e:  # a damaged pickle stream
        raise damaged(path, e) from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"{path}: damaged (not a torch distributed checkpoint's index)")
    return metadata


def check(folder: Path) -> None:
    """Refuse, in one line naming the file, a dist checkpoint `folder` any of whose pickles
    (`.metadata`, the objects in its shards, `common.pt`) names anything but data."""
    metadata = read_metadata(folder / METADATA)
    objects = {key for key, item in metadata.state_dict_metadata.items()
               if isinstance(item, BytesStorageMetadata)}
    where = {}  # file -> [(offset, length)] of its objects
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in objects:
            if getattr(info, "transform_descriptors", None):
                raise UserError(f"{folder / info.relative_path}: refused: {index.fqn} is "
                                "stored transformed, which this project never writes")
            where.setdefault(info.relative_path, []).append((info.offset, info.length))
    for name, spans in sorted(where.items()):
        with open(folder / name, "rb") as f:
            for offset, length in sorted(spans):
                f.seek(offset)
                _weights_only(folder / name, io.BytesIO(f.read(length)))
    if (folder / COMMON).is_file():
        _weights_only(folder / COMMON, folder / COMMON)


def _weights_only(path: Path, source) -> None:
    """Read `source` (the file `path`, or bytes of it) with torch's allow-listed unpickler."""
    try:
        torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = UNSUPPORTED.search(str(e))
        raise _refused(path, found[1] if found else "a function it names") from None
    except Exception as e:  # a damaged zip or pickle stream
        raise damaged(path, e) from None


def _refused(path: Path, what: str) -> UserError:
    return UserError(f"{path}: refused: loading it would call {what}, which can run any "
                     "code (a checkpoint holds data only there: the file was made or altered "
                     "elsewhere)")


def damaged(path: Path, e: Exception) -> UserError:
    detail = str(e).splitlines()[0][:80] if str(e).strip() else "empty or cut short"
    return UserError(f"{path}: damaged ({type(e).__name__}: {detail})")


class SafeFileSystemReader(FileSystemReader):
    """torch's reader of a dist checkpoint, its index read by the allow-listed unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path) / METADATA)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
