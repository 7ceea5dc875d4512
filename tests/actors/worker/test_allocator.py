"""The worker's allocator thresholds (actors.worker.allocator): freed step tensors are reused.

Counted, not timed: the minor page faults of a fresh process running 40 rounds of a 16-request
verification block's rows (``[80, 4096]`` logits into float64 rows, 2.5 MiB a tensor), with glibc's
starting thresholds (128 KiB, fixed) and after :func:`keep_freed_memory`. Each fresh mapping of a
freed block faults its pages in again; reused heap does not. Left to glibc's dynamic thresholds
the count depends on the heap's layout so far: ~75,000 on most runs, ~1,900 on some.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from actors.worker.allocator import keep_freed_memory

ROUNDS_SCRIPT = """
import resource, sys, torch
torch.set_num_threads(1)  # the workers run one thread (resources.torch_threads)
from actors.worker.allocator import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, glibc_mallopt, keep_freed_memory
from verifiers.penalties import penalized_probs
if sys.argv[1] == "kept":
    assert keep_freed_memory()
else:  # glibc's starting values, fixed: left dynamic, they move with the heap's layout so far
    mallopt = glibc_mallopt()
    assert mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1 and mallopt(M_TRIM_THRESHOLD, 128 * 1024) == 1
logits = torch.randn(80, 4096)
for _ in range(10):  # warm: the heap grows to the rounds' high-water mark either way
    penalized_probs(logits, temperature=1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    penalized_probs(logits, temperature=1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", ROUNDS_SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # subprocesses, warm rounds
def test_freed_step_tensors_are_reused_instead_of_faulted_in_again():
    default, kept = _faults("default"), _faults("kept")
    assert default > 40 * 100  # glibc's starting thresholds: each round maps and faults in fresh pages
    assert kept < default / 10, (default, kept)  # kept: the heap is reused (0 on most runs)


def test_keep_freed_memory_reports_that_it_set_the_thresholds():
    assert keep_freed_memory() is True
