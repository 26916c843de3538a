"""The C allocator's settings for a process that trains on the CPU.

glibc's ``malloc`` gives a large block (above its mmap threshold: 128 KiB at first,
rising to the largest such block freed, at most 32 MiB) pages of its own, and returns
the top of its heap to the system once more than twice the threshold lies free there. A
training step allocates and frees the same large tensors over and over (a LeNet-5
cohort's first convolution: 12 MB each step), so every step faults their pages in
again. :func:`keep_freed_memory` serves blocks up to 32 MiB from the heap and keeps up to
256 MiB of freed memory for the next step. The budget tool (``python -m sim budget
--model lenet5 --strategy fedkf --precision int8``, this project's 2-core CPU) went from
26.5 to 26.7 s (1.8 to 2.8 s of them in the kernel) to 24.7 to 25.0 s (0.4 to 0.5 s),
its peak memory 10 MB higher (docs/budget.md).

A command calls it for its own process; library functions leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["keep_freed_memory"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# glibc's <malloc.h> numbers for mallopt's parameters

_SETTINGS = (
    (_M_MMAP_THRESHOLD, 32 * 2**20),  # glibc's largest: blocks up to 32 MiB from the heap
    (_M_TRIM_THRESHOLD, 256 * 2**20),  # keep up to 256 MiB free at the heap's top
    (_M_TOP_PAD, 64 * 2**20),  # and grow the heap 64 MiB at a time
)


def keep_freed_memory() -> bool:
    """Tell glibc's ``malloc`` to serve blocks up to 32 MiB from its heap and keep up to
    256 MiB of freed memory (see the module's docstring).

    Returns:
        True when set; False where the C library is not glibc (musl, macOS, Windows):
        nothing is changed there; or where glibc refused a setting (the ones before it
        stay set).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    for parameter, value in _SETTINGS:
        if mallopt(parameter, value) != 1:
            log.debug("mallopt(%d, %d) refused", parameter, value)
            return False
    return True
