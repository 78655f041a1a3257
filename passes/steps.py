"""steps: run a pass under its name: a failure names the pass, its time is logged, and in debug
runs its graph is dumped before and after; and the garbage collector's full collections held
while the passes run (without_full_collections); and a graph's compile run from a fresh chunk of
the interpreter's frame stack (on_a_fresh_stack)."""

from __future__ import annotations

import contextlib
import gc
import time
import types
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
# AOTAutograd's state, the joint graph, the plans so far): on a deep model under a budget they
# took seconds of the compile, growing with the blocks. So the backend plans with the young
# generations collected as usual and the full collections held until it is done; what planning
# leaves as cyclic garbage in the oldest generation waits for the first full collection after it.
# The price is host memory while planning: about a tenth more resident on a 24-block model.


def on_a_fresh_stack(fn: Callable[[], T]) -> T:
    """fn(), its frames and those of everything it calls at the start of a chunk of the
    interpreter's frame stack large enough for them (Note [Compiling on a fresh stack chunk])."""
    return _on_a_fresh_stack(fn)


def _call(fn: Callable[[], T]) -> T:
    return fn()


STACK_RESERVE = 1 << 16
"""Value-stack slots reserved in the frame on_a_fresh_stack runs its function from: the chunk of
the frame stack that frame starts is then 1 MiB, about half of it left for the frames under it."""
_on_a_fresh_stack = types.FunctionType(
    _call.__code__.replace(co_stacksize=_call.__code__.co_stacksize + STACK_RESERVE), globals(), "_on_a_fresh_stack")

# Note [Compiling on a fresh stack chunk]
# Since Python 3.11 the interpreter keeps frames in chunks of a per-thread stack: a call that does
# not fit in the current chunk maps a fresh one (16 KiB), which is unmapped when that call
# returns. A loop whose calls cross a chunk's edge pays a mapping, page faults and an unmapping on
# every call (CPython issue gh-142183; 3.11 and 3.12 keep no chunk cached). Where the edges fall
# depends on how deep the caller is, so the same passes ran several times slower from one caller
# than from another (a partition with a hundred thousand page faults against one with none).
# So the backend compiles each graph (AOTAutograd's tracing, the passes, Inductor's compile of the
# forward) from a frame whose code reserves a large value stack (a frame's size is its code's
# locals plus co_stacksize): it does not fit in a 16 KiB chunk, so the call that makes it starts a
# chunk sized for it, 1 MiB, and every frame under it fits in what that chunk has left: no edge
# is crossed while the graph compiles, however deep the caller was (rewrite_graph traces and plans
# its graph from such a frame too). The reserved slots are never written: the chunk's untouched
# pages cost address space, not memory. The backward, which AOTAutograd compiles at the first
# backward pass, is compiled from wherever autograd calls it, as under Inductor alone.
