"""steps: run a pass under its name: a failure names the pass, its time is logged, and in debug
runs its graph is dumped before and after; and the garbage collector's full collections held
while the passes run (without_full_collections)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")
Dump = Callable[[str, str, torch.fx.GraphModule], None]


class PassError(RuntimeError):
    """A pass failed; carries the pass's name."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(f"ckpt_fx pass '{name}' failed: {type(error).__name__}: {error}")
        self.pass_name = name


class Steps:
    """Runs passes by name for one compiled graph; `timings` adds up each pass's seconds.
    `dump(pass_name, "before"|"after"|..., gm)`, when given, sees each pass's graph."""

    def __init__(self, dump: Dump | None = None):
        self.dump = dump
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], T], gm: torch.fx.GraphModule | None = None) -> T:
        """fn(), timed under `name`; any exception but a PassError becomes a PassError naming it."""
        if self.dump is not None and gm is not None:
            self.dump(name, "before", gm)
        start = time.perf_counter()
        try:
            result = fn()
        except PassError:
            raise
        except Exception as error:
            raise PassError(name, error) from error
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
        return result

    def show(self, name: str, stage: str, gm: torch.fx.GraphModule) -> None:
        """Dump `gm` as pass `name`'s graph at `stage`, in debug runs."""
        if self.dump is not None:
            self.dump(name, stage, gm)

    def summary(self) -> str:
        return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.timings.items())


@contextlib.contextmanager
def without_full_collections() -> Iterator[None]:
    """A context in which the cyclic garbage collector collects only its young generations (Note
    [Collections while planning]); its thresholds are as they were after."""
    if not gc.isenabled():
        yield
        return
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], FULL_COLLECTIONS_HELD))
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


FULL_COLLECTIONS_HELD = 1_000_000
"""The oldest generation's threshold while planning: young collections before a full one."""

# Note [Collections while planning]
# Planning lowers many graphs (each plan's partition and Inductor's schedules of its blocks), and
# the objects that outlive a young collection trigger the cyclic garbage collector's full
# collections, each of which walks every object in the process (the model, Dynamo's and
# AOTAutograd's state, the joint graph, the plans so far). Measured under `budget:0.5` on
# transformers' Llama 256 wide, batch 2 x 512 (torch 2.13, CPU, 2026-12-06, each after Inductor
# alone in one process): full collections took 4.1 s of the compile at 6 blocks (2.0 s of
# Inductor alone's) and 11.6 s at 24 (5.5 s of Inductor alone's). So the backend plans with the
# young generations collected as usual and the full collections held until it is done; what
# planning leaves as cyclic garbage in the oldest generation waits for the first full collection
# after it. At 24 blocks the budget's compile fell from 1.58x and 1.76x Inductor alone's to 1.47x
# and 1.54x in two pairs of runs (the README's compile-time table); at 6 blocks the change is
# within the machine's drift. The price is host memory: the process's peak resident set after that
# 24-block compile and one step was 1459 MB, against 1331 MB with full collections as usual.
