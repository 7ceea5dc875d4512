"""Freed memory kept for the next step: glibc's malloc tuned so a worker's step temporaries reuse
the heap instead of fresh pages.

A step's rows are host tensors of a few MiB: 16 requests' verification block of gamma 4 over a
4,096-token vocabulary is ``[16, 5, 4096]`` float64, 2.6 MiB, and every transform of it (the
softmax, the ratios, the residuals) allocates another. glibc serves an allocation above its
mmap threshold (128 KiB at first, raised as such blocks are freed) with a fresh ``mmap``, and
the heap's top above its trim threshold goes back to the kernel on free; either way the next
step's tensor lands on pages the kernel must fault in and zero. Measured on this machine (one
thread, ``penalized_probs`` of ``[80, 4096]`` logits into float64 rows): 3.3 ms with glibc's
defaults, 0.46 ms with both thresholds set (either alone: no better). vLLM's CPU build asks for
tcmalloc for the same reason; this needs no other library.

:func:`keep_freed_memory` sets both thresholds with ``mallopt`` (glibc's own knobs, what the
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment variables set): blocks up to
:data:`MMAP_THRESHOLD_BYTES` come from the heap, and up to :data:`TRIM_THRESHOLD_BYTES` of free
heap stay with the process. Larger allocations (a KV cache, a long prompt's mask) are mapped and
returned as before. The price: a worker keeps its step high-water mark (at most the trim
threshold more than it uses). Elsewhere than glibc on Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: Allocations below this come from the heap (glibc's largest on 64-bit: 32 MiB).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free heap kept with the process before any is returned to the kernel.
TRIM_THRESHOLD_BYTES = 256 << 20


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt(param, value)`` (1 when set); None off Linux or without glibc (musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # musl or no libc to load: nothing to tune
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process (see the module doc) -> whether
    they were set (False: not glibc on Linux, or ``mallopt`` refused a value). Once per process:
    a worker hosting several models asks for each."""
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if done:
        logger.info("malloc keeps freed memory: mmap threshold %d MiB, trim threshold %d MiB",
                    MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    else:
        logger.warning("glibc's mallopt refused the allocator thresholds; freed memory goes back to the kernel")
    return done
