"""The bench's setups: how one training step is run, by us or by the tools people use today, parsed
once from their names (`Setup.parse`) and applied to a fresh copy of the model (`Setup.prepare`)."""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_fx import policies
from ckpt_fx.dynamo_backend import CkptBackend, Options
from ckpt_fx.dynamo_backend import backend as ckpt_backend
from passes._compat import activation_memory_budget, own_backend, per_block_checkpointing, torch_offloading
from passes.costs import op_class
from passes.regions import block_stacks
from passes.targets import INDUCTOR

CPU_SETUPS = (
    "eager", "checkpoint", "inductor-budget:0.5", "ckpt:blocks", "ckpt:blocks:every=1,skip_first=0",
    "ckpt:selective", "ckpt:budget:0.5",
)
"""The default on a CPU under the default inner compiler, Inductor (what enable and backend="ckpt"
use): the peers and our plans as users run them. Inductor compiles a GPT-2 for a minute or two per
setup on a CPU."""
CPU_EAGER_SETUPS = (
    "eager", "checkpoint", "aot_eager-budget:0.5", "ckpt-eager:blocks", "ckpt-eager:blocks:every=1,skip_first=0",
    "ckpt-eager:selective", "ckpt-eager:budget:0.5",
)
"""The default on a CPU where the default inner compiler is the eager one (CKPT_FX_COMPILER=eager):
the same on eager kernels (torch's knob under aot_eager), a few minutes in all."""
CUDA_SETUPS = (
    "eager", "checkpoint", "inductor", "inductor-budget:0.5", "inductor-sac", "ckpt:none", "ckpt:blocks",
    "ckpt:blocks:every=1,skip_first=0", "ckpt:selective", "ckpt:budget:0.5", "ckpt:budget:0.3",
    "inductor-offload", "ckpt:offload", "ckpt:offload:every=1,skip_first=0", "ckpt:budget:0.3,offload",
)
"""The default on a GPU: the ground users train on (Inductor alone, torch's knob, torch's op-level
selective checkpointing, torch's offload of hand-tagged values) beside our plans under Inductor."""
SETUP_FORMS = (
    "eager, checkpoint, sac, inductor-sac, aot_eager, inductor, aot_eager-budget:<x>, inductor-budget:<x>, inductor-offload, "
    "ckpt:<policy> (the default inner compiler), ckpt-eager:<policy>, ckpt-inductor:<policy>"
)
PEERS = ("eager", "checkpoint", "sac", "inductor-sac", "aot_eager", "inductor")


def default_setups(device: str) -> tuple[str, ...]:
    """The setups a bench runs when none are named: CUDA_SETUPS on a GPU; on a CPU, CPU_SETUPS, or
    CPU_EAGER_SETUPS where the default inner compiler (CKPT_FX_COMPILER) is the eager one."""
    if device == "cuda":
        return CUDA_SETUPS
    return CPU_EAGER_SETUPS if Options.merged({}).get("compiler", "inductor") == "eager" else CPU_SETUPS


def sweep_setups(budgets: tuple[float, ...]) -> tuple[str, ...]:
    """Both budget lines at each budget, with the peers and our no-checkpoint and selective plans:
    torch's knob (inductor-budget:x) beside ckpt:budget:x, Inductor alone beside ckpt:none, torch's
    op-level selective checkpointing under Inductor beside ckpt:selective, HF per-block checkpointing
    beside ours on every block."""
    for x in budgets:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x <= 1:
            raise ValueError(f"--sweep: every budget must be a number in (0, 1], got {x!r}")
    lines = [s for x in budgets for s in (f"inductor-budget:{x:g}", f"ckpt:budget:{x:g}")]
    return ("eager", "checkpoint", "ckpt:blocks:every=1,skip_first=0", "inductor", "ckpt:none", "inductor-sac",
            "ckpt:selective", *lines)


class Kind(str, enum.Enum):
    """How a setup runs a training step."""

    EAGER = "eager"
    CHECKPOINT = "checkpoint"
    """HF's per-block checkpointing (torch.utils.checkpoint around every block)."""
    SAC = "sac"
    """torch's op-level selective checkpointing."""
    COMPILE = "compile"
    """torch.compile alone."""
    KNOB = "knob"
    """torch.compile under torch's activation_memory_budget."""
    TORCH_OFFLOAD = "torch-offload"
    """torch.compile (Inductor) with torch's offload pass on values tagged by hand: every matmul
    output the partition saves, torch's own waits and prefetch."""
    CKPT = "ckpt"
    """Ours."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One way to run a training step, read from its name."""

    name: str
    """As written, e.g. "ckpt-eager:budget:0.5"; the row's label."""
    kind: Kind
    compiler: str | None = None
    """torch.compile's backend ("aot_eager", "inductor") for compile and knob; our inner compiler
    for ckpt ("eager", "inductor", or None for the backend's default); "inductor" for inductor-sac."""
    budget: float | None = None
    """torch's knob's activation_memory_budget."""
    policy: policies.Policy | None = None
    """Our policy, parsed."""

    @staticmethod
    def parse(name: str) -> Setup:
        """The setup a name stands for; ValueError naming the valid forms."""
        if name in ("eager", "checkpoint", "sac"):
            return Setup(name=name, kind=Kind(name))
        if name == "inductor-sac":
            return Setup(name=name, kind=Kind.SAC, compiler="inductor")
        if name in ("aot_eager", "inductor"):
            return Setup(name=name, kind=Kind.COMPILE, compiler=name)
        if name == "inductor-offload":
            return Setup(name=name, kind=Kind.TORCH_OFFLOAD, compiler="inductor")
        compiler, _, knob = name.partition("-budget:")
        if knob and compiler in ("aot_eager", "inductor"):
            try:
                value = float(knob)
            except ValueError:
                value = -1.0
            if not 0 < value <= 1:
                raise ValueError(f"setup {name!r}: the budget must be a number in (0, 1]")
            return Setup(name=name, kind=Kind.KNOB, compiler=compiler, budget=value)
        head, sep, spec = name.partition(":")
        if sep and head in ("ckpt", "ckpt-eager", "ckpt-inductor"):
            return Setup(name=name, kind=Kind.CKPT, compiler=head.partition("-")[2] or None, policy=policies.parse(spec))
        raise ValueError(f"unknown setup {name!r}; valid: {SETUP_FORMS}")

    @property
    def ours(self) -> bool:
        return self.kind == Kind.CKPT

    @property
    def inductor_draws(self) -> bool:
        """Whether its random ops (dropout) run as Inductor's own kernels."""
        if self.ours and self.compiler is None:
            return ckpt_backend(policy="none").target is INDUCTOR
        return self.compiler == "inductor"

    def prepare(self, model: torch.nn.Module) -> tuple[Callable[..., Any], CkptBackend | None, Callable[[], Any]]:
        """(the callable to run a step through, our backend or None, a context to run it in),
        with `model` changed in place where the setup does so (HF per-block checkpointing)."""
        none = contextlib.nullcontext
        if self.kind == Kind.EAGER:
            return model, None, none
        if self.kind == Kind.CHECKPOINT:
            return checkpoint_every_block(model), None, none
        # Each setup compiles with a backend of its own: the bench keeps every setup compiled at once,
        # and Dynamo would serve one's graphs to another compiled under an equal backend.
        if self.kind == Kind.SAC:
            wrapped = checkpoint_every_block(model, selective=True)
            return (wrapped if self.compiler is None else torch.compile(wrapped, backend=own_backend(self.compiler))), None, none
        if self.kind == Kind.COMPILE:
            return torch.compile(model, backend=own_backend(self.compiler)), None, none
        if self.kind == Kind.TORCH_OFFLOAD:
            streams = next((p.device.type for p in model.parameters()), "cpu") == "cuda"
            return (torch.compile(model, backend=own_backend(self.compiler)), None,
                    functools.partial(torch_offloading, _is_matmul, streams=streams))
        if self.kind == Kind.KNOB:  # torch's own knob: the min-cut partitioner under an activation memory budget
            return (torch.compile(model, backend=own_backend(self.compiler)), None,
                    functools.partial(activation_memory_budget, self.budget))
        # Counting runs: the bench predicts the step it measures from the graphs that ran in it
        # (a recompile leaves the first graph's plan in b.plans too).
        b = CkptBackend(ckpt_backend(policy=self.policy, compiler=self.compiler, progress=False).options, count_runs=True)
        return torch.compile(model, backend=b), b, none


def parse_setups(names: tuple[str, ...]) -> tuple[Setup, ...]:
    """Every name parsed (a bad one refused, naming the valid forms, before any model is built)."""
    return tuple(Setup.parse(name) for name in names)


def _block_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The model's longest stack of repeated blocks (passes.regions.block_stacks)."""
    stacks = [model.get_submodule(name) for name in block_stacks(model)]
    if not stacks:
        raise ValueError("setup 'checkpoint' needs a model with a stack of repeated blocks (children named 0, 1, ... of one class)")
    return max(stacks, key=lambda stack: len(list(stack.children())))


def checkpoint_every_block(model: torch.nn.Module, *, selective: bool = False) -> torch.nn.Module:
    """What HF's activation checkpointing does: torch.utils.checkpoint around every block (HF's own
    switch where the model has one, else torch's apply_activation_checkpointing on the longest
    stack's members). `selective`: torch's op-level selective checkpointing inside each block
    instead (what torchtitan's op-level mode does): matmul and attention outputs saved, the rest
    recomputed."""
    options: dict[str, Any] = {}
    if selective:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    if getattr(model, "supports_gradient_checkpointing", False):
        return hf_checkpointing_enable(model, use_reentrant=False, **options)
    blocks = {id(b) for b in _block_stack(model).children()}
    return per_block_checkpointing(model, lambda m: id(m) in blocks, **options)


def hf_checkpointing_enable(model: torch.nn.Module, **checkpoint_kwargs: Any) -> torch.nn.Module:
    """A transformers model's own per-block checkpointing, switched on under its current name
    (activation_checkpointing_enable; gradient_checkpointing_enable before transformers 5.x
    renamed it), `checkpoint_kwargs` passed to torch.utils.checkpoint."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    return model


def _is_matmul(node: torch.fx.Node) -> bool:
    """A matmul's output: what the torch-offload setup tags for offloading, as a user would by hand."""
    return op_class(str(getattr(node.target, "overloadpacket", node.target))) == "matmul"


def _save_matmuls(ctx, op, *args, **kwargs):
    """torch's selective-checkpoint policy for the sac setups: save matmul and attention outputs."""
    from torch.utils.checkpoint import CheckpointPolicy

    packet = str(getattr(op, "_overloadpacket", op))
    return CheckpointPolicy.MUST_SAVE if op_class(packet) in ("matmul", "attention") else CheckpointPolicy.PREFER_RECOMPUTE
