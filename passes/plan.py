"""plan: what the passes decided for one compiled graph and the memory it is predicted to need;
the record explain, fit, bench and the backend's warnings read."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from passes.budget import Choice
    from passes.regions import Block


@dataclass(frozen=True, kw_only=True)
class SavedTensor:
    """One tensor the forward keeps for the backward."""

    name: str
    module_path: str
    block: str | None
    op: str
    """The op that made it (op_name): "convolution", "native_layer_norm[0]", "detach(relu)"."""
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    nbytes: int
    is_input: bool
    """A parameter, buffer or input (or a view of one): saving it costs no extra memory."""
    view_of: str | None = None
    """The node whose storage it shares when it is a view (detach, reshape, ...): its bytes are
    that storage's, counted once."""


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """What happens to one unit."""

    path: str
    saved_bytes: int
    recomputed_ops: int
    recompute_flops: int
    recomputed_bytes: int = 0
    """Bytes of the values it recomputes: what checkpointing it keeps out of the saved set."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one compiled graph saves and recomputes, and the memory it is predicted to need."""

    policy: str
    saved: tuple[SavedTensor, ...]
    recomputed: tuple[str, ...]
    """Names of the forward nodes the backward recomputes, in backward order."""
    blocks: tuple[BlockPlan, ...]
    saved_bytes: int
    """Bytes of saved activations (inputs and parameters excluded)."""
    recompute_flops: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    peak_model: str = "walk"
    """How the peaks were predicted: "inductor" from Inductor's own schedule of the graphs (Note
    [Inductor's own schedule] in passes/memory.py), "walk" by the memory pass's walk of them."""
    joint_cse: bool | None = None
    """Under min-cut, whether it merged identical nodes of the joint graph first (Note [CSE under
    recompute] in passes/partition.py); None under the default partition."""
    forward_end_bytes: int = 0
    """Bytes the forward leaves allocated: saved activations and outputs."""
    gradient_bytes: int = 0
    """Bytes of the parameter gradients the backward returns (they outlive the step)."""
    step_flops: int = 0
    """FLOPs of the graph's forward and backward, recomputation excluded."""
    hard_rules: dict[str, str] = field(default_factory=dict)
    """Nodes no policy may recompute, with why (random, mutation, ...)."""
    top_level_units: bool = False
    units: tuple[Block, ...] = ()
    """The graph's units in forward order (passes.regions): path, stack, calls, heavy, ..."""
    module_paths: tuple[str, ...] = ()
    """Every module path the graph's nodes came from, sorted."""
    recomputed_embedding_ops: int = 0
    """Embedding ops the policy asked to recompute: it saves nothing (the embedding's output is
    the next unit's input, kept anyway)."""
    budget: Choice | None = None
    """What a memory budget chose for this graph (the candidate's peak, the limit, the solver, the
    budget it reaches when none fits); None for other policies."""
    held_outputs: tuple[tuple[str, int], ...] = ()
    """(module path, bytes) of the values the graph returns from inside checkpointed units (a
    KV cache): they stay alive from the forward to the backward whatever the policy."""
    symbols: dict[str, int] = field(default_factory=dict)
    """Symbolic sizes of the graph's inputs (dynamic shapes): name -> the hint the figures above
    were made with. `at(...)` gives the plan's figures at other sizes."""
    _at: Callable[..., Plan] | None = field(default=None, compare=False, repr=False)

    @property
    def peak_bytes(self) -> int:
        """Predicted peak of a training step (Note [What the predicted peak counts])."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    def at(self, **sizes: int) -> Plan:
        """The same plan's figures (saved bytes, peaks) with symbolic sizes set, e.g.
        `plan.at(s1=2048)`; symbols not given keep their hints. One compiled graph serves every
        length under dynamic shapes; this predicts what it needs at each."""
        unknown = sorted(set(sizes) - set(self.symbols))
        if unknown:
            valid = ", ".join(f"{k} (now {v})" for k, v in sorted(self.symbols.items())) or "none: the sizes are static"
            raise ValueError(f"Plan.at: unknown size symbol(s) {unknown}; this plan's symbols: {valid}")
        if not sizes or self._at is None:
            return self
        return dataclasses.replace(self._at(sizes={k: int(v) for k, v in sizes.items()}), budget=self.budget,
                                   units=self.units, module_paths=self.module_paths,
                                   recomputed_embedding_ops=self.recomputed_embedding_ops)


def step_peak_bytes(plans: list[Plan] | tuple[Plan, ...]) -> int:
    """Predicted peak of a training step through several graphs (graph breaks), run forward in
    order and backward in reverse: while graph i runs, every earlier graph's forward leftovers
    and every later graph's gradients are live as well."""
    peak = 0
    for i, plan in enumerate(plans):
        before = sum(p.forward_end_bytes for p in plans[:i])
        after = sum(p.gradient_bytes for p in plans[i + 1 :])
        peak = max(peak, before + plan.forward_peak_bytes, before + after + plan.backward_peak_bytes)
    return peak
