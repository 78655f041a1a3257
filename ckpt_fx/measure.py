"""Measured peak memory of a piece of work: the profiler on CPU, the allocator's counter on CUDA."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import torch

from passes._compat import memory_events


def peak_bytes(fn: Callable[[], object], *, device: str | torch.device = "cpu") -> int:
    """Run fn once and return the peak of tensor bytes allocated above what was live before it.

    CPU: the profiler's memory events sorted by time; the running sum of their sizes has a maximum.
    CUDA: torch.cuda.max_memory_allocated() above the allocation at the start.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"peak_bytes: device must be 'cpu' or 'cuda', got {device}")
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's C++ side prints a line at start and at stop
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    running = peak = 0
    for nbytes in memory_events(prof):
        running += nbytes
        peak = max(peak, running)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ writes) for the duration; Python's stderr is flushed first."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
