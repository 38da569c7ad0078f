"""Process memory settings: what the allocator keeps after a forward/backward frees its activations.

No torch import: tests call it in a fresh interpreter before the first large allocation.
"""

from __future__ import annotations

import ctypes
import sys


def cap_mmap_threshold(kib: int) -> bool:
    """Fix glibc's mmap threshold at `kib` KiB; True if set (glibc), False elsewhere or for 0.

    By default glibc raises the threshold to the size of each mmap-ed block freed (up to 32 MiB), so from
    the first freed activation on, every buffer under 32 MiB comes from the heap. A forward/backward frees
    and allocates buffers of many sizes; the holes it leaves cannot be handed back to the OS, and peak
    RSS grows to 1.5-3x the memory in use (benchmarks/results/memory.md). A fixed threshold (which also
    fixes the trim threshold) gives every large tensor its own mapping, unmapped when it is freed.
    """
    if kib <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None).mallopt(-3, kib * 1024) == 1  # -3: M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):  # not glibc (musl has no effect; other libcs may lack mallopt)
        return False
