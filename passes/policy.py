"""policy: what a policy sees of a node (NodeInfo), what it is (a callable, a NamedPolicy, a
BudgetSpec), and the one module-path match every policy and warning uses."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

import torch

from passes._compat import CheckpointPolicy
from passes.regions import Block, RegionKind
from passes.solve import NODE_LIMIT


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """What a policy sees of one forward node."""

    name: str
    """The node's name in the joint graph."""
    op: str
    """The operator, e.g. "aten.mm.default" or "getitem"."""
    module_path: str
    """Innermost module path, e.g. "transformer.h.3.mlp.c_fc" ("" at the top)."""
    region: RegionKind
    """RegionKind.EMBEDDING, BLOCK or OTHER (equal to the strings "embedding", "block", "other")."""
    block: Block | None
    """The unit the node belongs to, when region is BLOCK."""
    user_blocks: tuple[Block | None, ...]
    """For each forward consumer (graph outputs included): its unit, or None outside any unit."""
    shape: tuple[int, ...] | None
    """Output shape (size hints for symbolic sizes); None for non-tensors."""
    dtype: torch.dtype | None
    """Output dtype; None for non-tensors."""
    nbytes: int
    """Bytes the output allocates (0 for views)."""
    flops: int
    """FLOPs of computing it once."""
    is_view: bool
    """The output aliases an input."""
    producer: str = ""
    """The op that computed the value: `op` itself, or for a getitem the op of the tuple it reads."""


Policy = Callable[[NodeInfo], CheckpointPolicy]


@dataclass(frozen=True, kw_only=True)
class NamedPolicy:
    """A per-node policy with a stable description: what the built-in policies are (any callable
    (NodeInfo) -> CheckpointPolicy is a policy too)."""

    decide: Policy
    spec: str
    """How it was written, e.g. "blocks(every=1, skip_first=1)": logs, plans, cache keys."""
    uses_blocks: bool = True
    """False for a policy that does not look at blocks (none, graph): a graph without them is no
    cause for a warning."""
    patterns: tuple[str, ...] = ()
    """only_in's module-path patterns, checked against each graph's paths."""
    alike_per_block: bool = False
    """True for a policy that decides every block of a stack of alike blocks alike, whatever the
    stack's length: a plan of a few such blocks extrapolates to many (fit's cut models)."""
    whole_units: bool = False
    """True for a policy that recomputes the whole of each unit it checkpoints, saving only what
    enters it (blocks, segments, sqrt): its backward is lowered with no horizontal fusion of a
    recomputed node (Note [A backward's blocks kept apart] in passes/inductor_memory.py)."""

    def __call__(self, info: NodeInfo) -> CheckpointPolicy:
        return self.decide(info)

    def __repr__(self) -> str:
        return self.spec


@dataclass(frozen=True, kw_only=True)
class BudgetSpec:
    """A memory budget (ckpt_fx.policies.budget): not a per-node policy but a problem the budget
    search solves over the whole graph (passes.budget.choose), its choice recorded in the Plan."""

    spec: str
    fraction: float | None
    """The limit as a fraction of the activation memory without checkpointing, or None."""
    nbytes: int | None
    """The limit as bytes of the step's predicted peak, or None."""
    shown: str
    """The limit as written, for messages."""
    solver: str = "auto"
    node_limit: int = NODE_LIMIT
    costs: str = "roofline"
    offload: bool = False
    """Values may also be kept in host memory (Note [Offload] in passes/offload.py)."""
    bandwidth: float | None = None
    """Bytes per second a host copy moves; None: torch's activation_offload_cpu_gpu_bw."""
    uses_blocks: bool = False

    def __call__(self, info: NodeInfo) -> CheckpointPolicy:
        raise RuntimeError(f"{self.spec} decides over the whole graph: the budget search solves it, not per node")

    def __repr__(self) -> str:
        return self.spec


def uses_blocks(policy: Policy) -> bool:
    """Whether a policy decides by blocks: False for none(), graph() and a budget, which need no
    blocks (no warning when a graph has none, or when they recompute nothing); True for the block
    policies and any other callable."""
    return policy.uses_blocks if isinstance(policy, (NamedPolicy, BudgetSpec)) else True


def matches_path(path: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether a module path matches one of the fnmatch patterns, or lies beneath a path one names
    ("model.layers.*" matches "model.layers.3" and "model.layers.3.mlp")."""
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p + ".*") for p in patterns)
