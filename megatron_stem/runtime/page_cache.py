"""What of a file the page cache holds, and reads that bring in only what they ask for.

A read of a cold page costs a disk or network round trip, and the kernel's read-ahead
turns each into hundreds of KB (a parallel filesystem's into MBs): a rank that samples a
few places of many large files reads them at random, with read-ahead off. `resident`
and `drop` measure that (bench/data_scale.py, tests/data/): `mincore` on a mapping of the
file says which of its pages are in memory, `POSIX_FADV_DONTNEED` drops its clean pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def pread_randomly(path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each (offset, length) of `path`, read with the kernel's read-ahead off
    for this open file: each read brings in the pages it covers, no more."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return [os.pread(fd, length, offset) for offset, length in ranges]
    finally:
        os.close(fd)


def resident(path: str) -> int:
    """Bytes of `path` in the page cache (whole pages)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = np.zeros((size + PAGE - 1) // PAGE, np.uint8)
            if _LIBC.mincore(address, size, pages.ctypes.data) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return int(np.count_nonzero(pages & 1)) * PAGE
        finally:
            _LIBC.munmap(address, size)
    finally:
        os.close(fd)


def drop(path: str) -> None:
    """Drop `path`'s pages from the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
