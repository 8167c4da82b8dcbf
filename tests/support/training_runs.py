"""What the trainer's end-to-end tests (tests/training/, tests/checkpoint/test_resume.py) read and write: toy
`.bin/.idx` data, loss curves, TensorBoard scalars and dist checkpoints compared whole.
The runs themselves are conftest.py's `train` and `reference` fixtures."""

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def write_documents(prefix: str, seed: int, document, count: int = 400) -> str:
    """`count` documents `document(rng)` (ids below 290), each ended by eod = 299, as the
    `.bin/.idx` pair `prefix`."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(count):
        doc = np.append(document(rng), 299)
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def progressions(strides=(1, 4), lengths=(20, 80)):
    """Arithmetic-progression documents, strides and lengths drawn from [a, b)."""
    def draw(rng):
        start, stride, length = rng.integers(0, 290), rng.integers(*strides), \
            rng.integers(*lengths)
        return (start + stride * np.arange(length)) % 290
    return draw


def assert_same_curve(losses, expected, rel=1e-5):
    assert len(losses) == len(expected)
    assert losses == pytest.approx(expected, rel=rel)


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over every event file in `folder` (a resumed run adds one)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.tensor.float_val[0]
    return out


def assert_same_checkpoints(ours, theirs):
    """Every weight and optimizer state of two checkpoints, bit for bit (an ulp shows here
    long before it reaches the loss)."""
    for part in ("model", "optim"):
        mine, other = saved_tensors(ours / part), saved_tensors(theirs / part)
        assert mine.keys() == other.keys()
        assert [k for k in mine if not torch.equal(mine[k], other[k])] == []


def saved_tensors(folder) -> dict[str, torch.Tensor]:
    """The tensors of a megatron dist checkpoint (torch_dist format), read whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder.parent / f"{folder.name}.pt")
    state = torch.load(folder.parent / f"{folder.name}.pt", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def tensor_digests(ckpt) -> dict[str, str]:
    """{"model/<key>" or "optim/<key>": xxh3 of its bytes} of every tensor of a checkpoint:
    what a checkpoint's contents are, in a few kilobytes (tests/fixtures/)."""
    import xxhash

    return {f"{part}/{key}": xxhash.xxh3_64(
        value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for part in ("model", "optim") for key, value in saved_tensors(ckpt / part).items()}
