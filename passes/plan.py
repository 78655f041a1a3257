"""plan: the records of what the passes decided for one compiled graph and the memory it is
predicted to need. The memory pass predicts (Prediction), a budget chooses (Choice), and
`assemble` makes the one Plan that explain, fit, bench and the backend's warnings read."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from passes.head import Head
    from passes.regions import Block
    from passes.select import HardRule


# Saved values that are no activations, by the op that made them (SavedTensor.op): what random ops
# need to draw the same numbers again, and dropout masks (eager's, and Inductor's comparisons of
# its own random numbers).
RANDOM_STATE_OPS = ("inductor_seeds", "inductor_lookup_seed", "run_and_save_rng_state", "graphsafe_run_with_rng_state",
                    "get_rng_state", "philox_rand", "philox_seed_like")
DROPOUT_MASK_OPS = ("native_dropout[1]", "gt(inductor_random)", "lt(inductor_random)", "ge(inductor_random)",
                    "le(inductor_random)")


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
    offloaded: bool = False
    """Kept in host memory between the forward and the backward (Note [Offload] in
    passes/offload.py); its bytes are host bytes."""
    draws_nothing: bool = False
    """A random-number state saved around an op that draws no random number (attention called
    with dropout_p=0, which torch 2.13's partitioners treat as random): no mask depends on it."""

    @property
    def kind(self) -> str:
        """"activation", "dropout mask" or "random-number state" (what random ops need to draw the
        same numbers again): read from the op that made it, through detach and alias."""
        inner = self.op
        while inner.startswith(("detach(", "alias(")) and inner.endswith(")"):
            inner = inner[inner.index("(") + 1 : -1]
        if inner.split("[")[0] in RANDOM_STATE_OPS:
            return "random-number state"
        if inner in DROPOUT_MASK_OPS:
            return "dropout mask"
        return "activation"


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """What happens to one unit."""

    path: str
    saved_bytes: int
    recomputed_ops: int
    recompute_flops: int
    recomputed_bytes: int = 0
    """Bytes of the values it recomputes: what checkpointing it keeps out of the saved set."""
    offloaded_bytes: int = 0
    """Bytes of its saved values kept in host memory between the forward and the backward."""
    forward_flops: int = 0
    """FLOPs of its forward: the compute its copies to host memory run beside."""


class PeakModel(str, enum.Enum):
    """How a plan's peaks were predicted."""

    INDUCTOR = "inductor"
    """From Inductor's own schedule of the graphs (Note [Inductor's own schedule] in
    passes/inductor_memory.py)."""
    WALK = "walk"
    """By the memory pass's walk of the graphs (passes.liveness)."""


class Source(str, enum.Enum):
    """Where a budget's chosen plan came from."""

    SOLVER = "solver"
    """A solver's plan (Choice.solver names it)."""
    UNCHANGED = "unchanged"
    """Nothing recomputed by us: the graph as the partitioner plans it alone (Inductor's own plan
    under min-cut)."""
    TORCH_KNOB = "torch-knob"
    """torch's own plan at the same budget (Note [Torch's knob as a candidate] in passes/budget.py)."""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """A candidate's predicted step peak: what a budget judges it by."""

    peak_bytes: int
    gradient_bytes: int


@dataclass(frozen=True, kw_only=True)
class Choice:
    """What a memory budget chose for one graph."""

    limit_bytes: int
    baseline_peak: int
    """Predicted peak of the plan that recomputes nothing: what a fraction counts from."""
    smallest_peak: int
    """The lowest predicted peak among the plans judged."""
    peak: int
    cost: float
    """Recompute cost of the chosen plan (Note [Roofline cost] in passes/costs.py)."""
    source: Source
    solver: str | None
    """The solver whose plan was chosen, when source is Source.SOLVER."""
    candidates: int
    """Distinct plans judged."""
    reached: float | None = None
    """When no plan fit: the budget (as a fraction) the chosen, lowest plan reaches."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the memory pass predicts of one partitioned graph (Note [What the predicted peak
    counts] in passes/memory.py); `at(sizes)` predicts it again with symbolic sizes set."""

    saved: tuple[SavedTensor, ...]
    recomputed: tuple[str, ...]
    """Names of the forward nodes the backward recomputes, in backward order."""
    blocks: tuple[BlockPlan, ...]
    saved_bytes: int
    """Bytes of saved activations kept on the device (inputs, parameters and offloaded values
    excluded)."""
    recompute_flops: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    peak_model: PeakModel = PeakModel.WALK
    forward_end_bytes: int = 0
    """Bytes the forward leaves allocated: saved activations and outputs."""
    gradient_bytes: int = 0
    """Bytes of the parameter gradients the backward returns (they outlive the step)."""
    step_flops: int = 0
    """FLOPs of the graph's forward and backward, recomputation excluded."""
    held_outputs: tuple[tuple[str, int], ...] = ()
    """(module path, bytes) of the values the graph returns from inside checkpointed units (a
    KV cache): they stay alive from the forward to the backward whatever the policy."""
    offloaded: tuple[str, ...] = ()
    """Names of the saved values kept in host memory between the forward and the backward, in
    forward order."""
    offloaded_bytes: int = 0
    """Host bytes they take (each copied out once and back once)."""
    symbols: dict[str, int] = field(default_factory=dict)
    """Symbolic sizes of the graph's inputs (dynamic shapes): name -> the hint the figures above
    were made with."""
    at: Callable[[dict[str, int]], Prediction] | None = field(default=None, compare=False, repr=False)

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    def estimate(self) -> Estimate:
        return Estimate(peak_bytes=self.peak_bytes, gradient_bytes=self.gradient_bytes)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """One plan of a joint graph: the graphs handed back and what the memory pass predicts of them."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    prediction: Prediction
    joint_cse: bool | None
    """Under min-cut, whether it merged identical nodes of the joint graph first; None otherwise."""
    recomputed_embedding_ops: int = 0
    """Embedding ops the policy asked to recompute."""


@dataclass(frozen=True, kw_only=True)
class GraphFacts:
    """What the regions pass found in a joint graph, recorded in its Plan."""

    units: tuple[Block, ...] = ()
    """The graph's units in forward order (passes.regions): path, stack, calls, heavy, ..."""
    module_paths: tuple[str, ...] = ()
    """Every module path the graph's nodes came from, sorted."""
    top_level_units: bool = False
    """No stack of repeated blocks: top-level children served as units."""
    checkpointed_by_model: tuple[str, ...] = ()
    """Units the model checkpointed itself (torch.utils.checkpoint regions, e.g. Hugging Face's
    gradient checkpointing): the plan replaces that checkpointing."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one compiled graph saves, recomputes and offloads, and the device memory it is
    predicted to need: the memory pass's Prediction, the regions pass's GraphFacts and what the
    backend adds, each held once; the figures read through (plan.saved_bytes is
    plan.prediction.saved_bytes)."""

    policy: str
    prediction: Prediction
    """What the memory pass predicts of the graphs handed back (its `at` predicts other sizes)."""
    facts: GraphFacts = field(default_factory=GraphFacts)
    """What the regions pass found: units, module paths, the model's own checkpointing."""
    joint_cse: bool | None = None
    """Under min-cut, whether it merged identical nodes of the joint graph first (Note [CSE under
    recompute] in passes/partition.py); None under the default partition."""
    hard_rules: dict[str, HardRule] = field(default_factory=dict)
    """Nodes no policy may recompute, with why (random, mutation, ...: equal to those strings)."""
    recomputed_embedding_ops: int = 0
    """Embedding ops the policy asked to recompute: it saves nothing (the embedding's output is
    the next unit's input, kept anyway)."""
    budget: Choice | None = None
    """What a memory budget chose for this graph (the candidate's peak, the limit, where the plan
    came from, the budget it reaches when none fits); None for other policies."""
    heads: tuple[Head, ...] = ()
    """Loss heads run in chunks (Note [The loss head in chunks] in passes/head.py)."""
    head_reasons: tuple[str, ...] = ()
    """Why each cross-entropy of the graph that was not chunked was left whole."""
    from_cache: bool = False
    """Recorded when the graph was compiled in an earlier process and read back as Inductor's cache
    served that graph (Note [Plans of cached graphs] in ckpt_fx/dynamo_backend.py): its figures
    hold at the sizes it was made for; `at` needs the graph planned again."""

    # The prediction's figures (documented on Prediction) and the regions pass's facts (on
    # GraphFacts), read through.
    saved = property(lambda self: self.prediction.saved)
    recomputed = property(lambda self: self.prediction.recomputed)
    blocks = property(lambda self: self.prediction.blocks)
    saved_bytes = property(lambda self: self.prediction.saved_bytes)
    recompute_flops = property(lambda self: self.prediction.recompute_flops)
    forward_peak_bytes = property(lambda self: self.prediction.forward_peak_bytes)
    backward_peak_bytes = property(lambda self: self.prediction.backward_peak_bytes)
    peak_model = property(lambda self: self.prediction.peak_model)
    forward_end_bytes = property(lambda self: self.prediction.forward_end_bytes)
    gradient_bytes = property(lambda self: self.prediction.gradient_bytes)
    step_flops = property(lambda self: self.prediction.step_flops)
    held_outputs = property(lambda self: self.prediction.held_outputs)
    offloaded = property(lambda self: self.prediction.offloaded)
    offloaded_bytes = property(lambda self: self.prediction.offloaded_bytes)
    symbols = property(lambda self: self.prediction.symbols)
    units = property(lambda self: self.facts.units)
    module_paths = property(lambda self: self.facts.module_paths)
    top_level_units = property(lambda self: self.facts.top_level_units)
    checkpointed_by_model = property(lambda self: self.facts.checkpointed_by_model)

    @property
    def peak_bytes(self) -> int:
        """Predicted device peak of a training step (Note [What the predicted peak counts])."""
        return self.prediction.peak_bytes

    def at(self, *, gradient_shards: int = 1, **sizes: int) -> Plan:
        """The same plan's figures (saved bytes, peaks) with symbolic sizes set, e.g.
        `plan.at(s1=2048)`; symbols not given keep their hints. One compiled graph serves every
        length under dynamic shapes; this predicts what it needs at each. `gradient_shards`: each
        parameter's gradient keeps one of that many parts on the device, the rest leaving with
        FSDP's reduce-scatter (the walk's estimate; needs a plan with symbolic sizes)."""
        unknown = sorted(set(sizes) - set(self.symbols))
        if unknown:
            valid = ", ".join(f"{k} (now {v})" for k, v in sorted(self.symbols.items())) or "none: the sizes are static"
            raise ValueError(f"Plan.at: unknown size symbol(s) {unknown}; this plan's symbols: {valid}")
        if sizes and self.from_cache:
            raise ValueError("Plan.at: this plan was read back with a graph Inductor's cache served, and holds its "
                             f"figures at {self.symbols} only; to predict other sizes, plan the graph again "
                             "(TORCHINDUCTOR_AUTOGRAD_CACHE=0, or ckpt_fx.fit / explain)")
        at = self.prediction.at
        if gradient_shards != 1 and at is None:
            raise ValueError("Plan.at: gradient_shards needs a plan traced with symbolic sizes (fit marks the batch "
                             "dynamic)")
        if (not sizes and gradient_shards == 1) or at is None:
            return self
        values = {k: int(v) for k, v in sizes.items()}
        prediction = at(values, gradient_shards=gradient_shards) if gradient_shards != 1 else at(values)
        # The figures at these sizes; `at` stays the one that predicts from the traced graph.
        return dataclasses.replace(self, prediction=dataclasses.replace(prediction, at=at))


def assemble(planned: Planned, *, policy: str, facts: GraphFacts, hard_rules: dict[str, HardRule],
             choice: Choice | None = None) -> Plan:
    """The Plan of one compiled graph: the memory pass's prediction of the graphs handed back, what
    the regions pass found, the hard rules, and a budget's choice. The only place a Plan is made."""
    return Plan(policy=policy, prediction=planned.prediction, facts=facts, joint_cse=planned.joint_cse,
                hard_rules=dict(hard_rules), recomputed_embedding_ops=planned.recomputed_embedding_ops, budget=choice)


def step_peak_bytes(plans: list[Plan] | tuple[Plan, ...]) -> int:
    """Predicted peak of a training step through several graphs (graph breaks), run forward in
    order and backward in reverse: while graph i runs, every earlier graph's forward leftovers
    and every later graph's gradients are live as well."""
    if not plans:
        raise ValueError("step_peak_bytes: no plans to predict from (no graph compiled yet with gradients recorded, "
                         "or every graph fell back without a plan: see the warnings)")
    peak = 0
    for i, plan in enumerate(plans):
        before = sum(p.forward_end_bytes for p in plans[:i])
        after = sum(p.gradient_bytes for p in plans[i + 1 :])
        peak = max(peak, before + plan.forward_peak_bytes, before + after + plan.backward_peak_bytes)
    return peak
