"""Memory on a rank (``ase_shard.memory``): freed memory given back to the system."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ase_shard.comm import Comm
from ase_shard.memory import release_free_memory

pytestmark = pytest.mark.skipif(Comm().size > 1, reason="serial: this process's memory")


def _resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


def test_freed_heap_memory_goes_back_to_the_system() -> None:
    """192 MB of 64 kB arrays (glibc's heap, not mmap), seven in eight freed: the heap
    keeps them (holes between the kept ones) until :func:`release_free_memory`."""
    chunks = [np.ones(8192) for _ in range(3000)]
    kept = chunks[::8]
    del chunks
    held = _resident_mib()
    assert release_free_memory()
    assert held - _resident_mib() > 100, (held, _resident_mib())
    assert all(chunk[0] == 1.0 for chunk in kept)
