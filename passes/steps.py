"""steps: run a pass under its name: a failure names the pass, its time is logged, and in debug
runs its graph is dumped before and after."""

from __future__ import annotations

import time
from collections.abc import Callable
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
