"""keep_freed_memory: large blocks come from the heap, and freed ones stay there."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

CODE = """
import ctypes, sys
from sim.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = keep_freed_memory() if sys.argv[1] == "kept" else None
block = libc.malloc(16 * 2**20)  # a step's activation
held = libc.mallinfo2()
libc.free(block)
freed = libc.mallinfo2()
print(applied, held.hblkhd, freed.fordblks)
"""

BLOCK = 16 * 2**20


def _glibc_with_mallinfo2() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return hasattr(ctypes.CDLL(None), "mallinfo2")


def _allocate(mode: str) -> tuple[str, int, int]:
    done = subprocess.run(
        [sys.executable, "-c", CODE, mode], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    applied, mapped, free = done.stdout.split()
    return applied, int(mapped), int(free)


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc >= 2.33's malloc only")
def test_a_large_block_comes_from_the_heap_and_stays_there_once_freed() -> None:
    # Execute: a 16 MiB block allocated and freed in a fresh process, without and with
    _, mapped_default, free_default = _allocate("default")
    applied, mapped_kept, free_kept = _allocate("kept")

    # Assert: by default the block has pages of its own (mmap), which go back to the
    # system when it is freed; once set, it comes from the heap and stays there, free
    # for the next step
    assert applied == "True"
    assert mapped_default >= BLOCK and free_default < BLOCK
    assert mapped_kept < BLOCK and free_kept >= BLOCK
