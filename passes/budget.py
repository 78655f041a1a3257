"""budget: turn a joint graph into a recompute Problem (passes.solve) and a solution back into
recompute decisions; choose among the candidates by their predicted peaks. The pipeline asks the
memory-budget policy for its candidates (Candidates) and a Chooser picks one
(passes.pipeline._choose); the choice is recorded in the graph's Plan (Plan.budget).

Values: the forward call nodes. A view cannot be saved on its own (saving it keeps its base
alive): it is recomputed from its base, for free. A tuple-valued node is read through its getitems,
which carry the bytes. Embeddings and hard-ruled nodes (random, mutating, collectives) are never
recomputed. Graph inputs and parameters are always at hand and are not values.

Note [Block boundaries under a budget]
Saved bytes alone do not bound the peak: a value recomputed for block 11's backward from block 0's
input rebuilds blocks 0..10 at once, and those stay alive until their own backward: measured on a
GPT, a budget of 0.05 peaked higher than one of 0.1. So when the graph has blocks, what leaves a
block (its output, read by the next) is always saved, as the block policies do: a recompute never
reaches past one block, and the peak falls with the budget. The smallest feasible budget is then
about per-block checkpointing's saved bytes. Likewise what enters a block from outside any block
(rotary tables computed once and read by every block) is saved: a recompute stays inside its
block, and the blocks are independent parts for the solver (Note [Independent parts]).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from passes._compat import CheckpointPolicy, pytree, size_hint
from passes.costs import BYTES_KEY, FLOPS_KEY, is_multi_output, is_view, tensor_bytes
from passes.memory import Estimate
from passes.regions import REGION_KEY, forward_nodes
from passes.solve import NODE_LIMIT, Problem, Solution, save_all, solve

# Note [Roofline cost]
# The recompute cost of a node is its time on a roofline: max(FLOPs / peak FLOP/s, bytes moved /
# bandwidth), bytes moved being its inputs' and output's sizes. Only ratios between nodes matter to
# the solver, so the constants need to be right in proportion, not exactly: they put matmuls
# (compute-bound) and pointwise ops (memory-bound) on one scale.
ROOFLINES = {  # device type: (FLOP/s, bytes/s)
    "cpu": (2e11, 2e10),
    "cuda": (4e14, 3e12),
}
_OVERHEAD_S = 1e-6  # per op: launching anything costs something


@dataclass(frozen=True)
class Graph:
    """A Problem and the nodes its values stand for."""

    problem: Problem
    nodes: tuple[torch.fx.Node, ...]
    boundaries: frozenset[int] = frozenset()
    """Values crossing a block's edge (Note [Block boundaries under a budget])."""


def roofline_cost(node: torch.fx.Node, device: str, *, fused: bool = False) -> float:
    """Note [Roofline cost]; `fused`: the inner compiler fuses pointwise ops into their consumers
    (Inductor), so recomputing one costs reading its inputs once more: no launch, no output written."""
    flops_s, bytes_s = ROOFLINES.get(device, ROOFLINES["cuda"])
    if is_view(node) or node.target is operator.getitem:
        return 0.0
    reads = sum(tensor_bytes(arg.meta.get("val")) for arg in node.all_input_nodes)
    if fused and is_pointwise(node):
        return reads / bytes_s
    moved = reads + tensor_bytes(node.meta.get("val"))
    return _OVERHEAD_S + max(node.meta.get(FLOPS_KEY, 0) / flops_s, moved / bytes_s)


def is_pointwise(node: torch.fx.Node) -> bool:
    """An elementwise aten op (torch's `pointwise` tag): what Inductor fuses into its consumer."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags


def measured_costs(device: str) -> Callable[[torch.fx.Node], float]:
    """A cost per node from timing it: the op run on random tensors of its arguments' shapes and
    dtypes (integers as zeros, so indices stay in range), best of three after a warm-up. Ops alike
    in target, shapes and arguments are timed once. A node that cannot be run this way (an op
    needing particular values) gets its roofline cost."""
    import time

    seen: dict[tuple, float] = {}

    def real(value: object) -> object:
        if isinstance(value, torch.fx.Node):
            value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            shape = tuple(size_hint(d) for d in value.shape)
            if value.dtype.is_floating_point or value.dtype.is_complex:
                return torch.randn(shape, dtype=value.dtype, device=device)
            return torch.zeros(shape, dtype=value.dtype, device=device)
        if isinstance(value, torch.SymInt):
            return size_hint(value)
        return value

    def describe(value: object) -> object:
        value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(size_hint(d) for d in value.shape), value.dtype)
        return repr(value)

    def cost(node: torch.fx.Node) -> float:
        if is_view(node) or node.target is operator.getitem or node.op != "call_function":
            return 0.0
        key = (str(node.target), tuple(map(describe, node.args)), tuple((k, describe(v)) for k, v in node.kwargs.items()))
        if key not in seen:
            try:
                args = pytree.tree_map(real, node.args)
                kwargs = pytree.tree_map(real, node.kwargs)
                times = []
                with torch.no_grad():
                    for _ in range(4):
                        start = time.perf_counter()
                        node.target(*args, **kwargs)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                seen[key] = min(times[1:])
            except Exception:  # noqa: BLE001 - an op that needs particular values: the roofline
                seen[key] = roofline_cost(node, device)
        return seen[key]

    return cost


def graph_device(gm: torch.fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def build_problem(
    gm: torch.fx.GraphModule,
    *,
    hard_rules: dict[str, str],
    cost: Callable[[torch.fx.Node], float] | None = None,
    fused: bool = False,
) -> Graph:
    """The recompute Problem of a joint graph whose nodes carry regions and costs; `fused` prices
    pointwise ops as fused into their consumers (roofline_cost) when no `cost` is given."""
    device = graph_device(gm)
    cost = cost or (lambda n: roofline_cost(n, device, fused=fused))
    fwd = forward_nodes(gm.graph)
    fwd_set = set(fwd)
    nodes = tuple(n for n in fwd if n.op == "call_function")
    index = {n: i for i, n in enumerate(nodes)}
    names, nbytes, costs, inputs, needed, saveable, recomputable = [], [], [], [], [], [], []
    for node in nodes:
        names.append(node.name)
        view_or_tuple = is_view(node) or is_multi_output(node) or isinstance(node.meta.get("val"), (tuple, list))
        nbytes.append(0 if view_or_tuple else node.meta.get(BYTES_KEY, 0))
        costs.append(cost(node))
        inputs.append(tuple(sorted({index[a] for a in node.all_input_nodes if a in index})))
        needed.append(any(u not in fwd_set and u.op != "output" for u in node.users))
        saveable.append(not view_or_tuple)
        region = node.meta.get(REGION_KEY)
        recomputable.append(node.name not in hard_rules and not (region is not None and region.kind == "embedding"))
    edges = _boundaries(nodes, index, saveable)
    for i in edges:
        recomputable[i] = False
        needed[i] = True  # always saved: the blocks are then independent parts
    problem = Problem(
        names=tuple(names), nbytes=tuple(nbytes), cost=tuple(costs), inputs=tuple(inputs),
        needed=tuple(needed), saveable=tuple(saveable), recomputable=tuple(recomputable),
    )
    return Graph(problem=problem, nodes=nodes, boundaries=frozenset(edges))


def _block_of(node: torch.fx.Node) -> object | None:
    region = node.meta.get(REGION_KEY)
    return region.block if region is not None and region.kind == "block" else None


def _boundaries(nodes: tuple[torch.fx.Node, ...], index: dict[torch.fx.Node, int], saveable: list[bool]) -> set[int]:
    """Values that leave a block for a later forward node outside it, or enter one from outside
    any block (Note [Block boundaries under a budget]); a view or tuple element crossing stands
    for the value it is read from."""
    out: set[int] = set()
    for node in nodes:
        block = _block_of(node)
        if any(u in index and _block_of(u) != block and (block is not None or _block_of(u) is not None) for u in node.users):
            stack = [node]
            while stack:
                n = stack.pop()
                if n not in index:
                    continue
                if saveable[index[n]]:
                    out.add(index[n])
                else:
                    stack.extend(a for a in n.all_input_nodes if a in index)
    return out


def baseline_bytes(problem: Problem) -> int:
    """Bytes saved when nothing is recomputed: every value the backward reads (a view's base)."""
    return sum(problem.nbytes[i] for i in save_all(problem))


def decisions(graph: Graph, solution: Solution, *, fused: bool = False) -> dict[str, CheckpointPolicy]:
    """MUST_RECOMPUTE for recomputed values; MUST_SAVE for saved ones; PREFER_SAVE for the rest
    (values the backward never reads).

    `fused` (min-cut partition, Note [Min-cut under Inductor]): only block edges are MUST_SAVE, and
    only when the plan recomputes something; the other saved values are PREFER_SAVE, so min-cut may
    still recompute the cheap fusible ones, as Inductor alone would. A plan that recomputes nothing
    is then exactly Inductor's own partition."""
    out = {}
    for i, node in enumerate(graph.nodes):
        if i in solution.recomputed:
            out[node.name] = CheckpointPolicy.MUST_RECOMPUTE
        elif i in solution.saved and (not fused or (solution.recomputed and i in graph.boundaries)):
            out[node.name] = CheckpointPolicy.MUST_SAVE
        else:
            out[node.name] = CheckpointPolicy.PREFER_SAVE
    return out


# Note [Peak-aware budget]
# The saved bytes a solver bounds are not the peak: recomputation rebuilds values that then live
# until their backward. So budget() plans a fixed set of candidates (the solver's plans at fixed
# fractions of the no-recompute saved bytes, then the plan that saves least), predicts each one's
# step peak and picks the cheapest whose peak fits the limit. Under the default partition every
# candidate's peak comes from the joint graph (JointLiveness), most saved first until one fits.
# Under min-cut a peak needs the candidate partitioned and Inductor's schedule of it (seconds for
# a large graph), so the cheapest fitting one is found by bisection over the candidates, whose
# peaks fall as they save less (a bisection over peaks that do not fall may pick a costlier plan
# that fits, never one that does not); torch's own plan at the same budget takes part (Note
# [Torch's knob as a candidate]). The candidates do not depend on the limit, so a lower limit picks
# either the same plan (it still fits and is still the cheapest) or one whose peak is below the
# new limit, hence below the old pick's: the predicted peak never rises as the limit falls. (With
# torch's plan taking part that holds for ours: torch's knob is not monotone, and where its plan at
# a higher budget is leaner than our limit at a lower one, the higher budget keeps less.)


@dataclass(frozen=True)
class Choice:
    """What budget() chose for one graph."""

    limit_bytes: int
    baseline_peak: int
    smallest_peak: int
    peak: int
    cost: float
    solver: str
    candidates: int
    reached: float | None = None
    """When no plan fit: the budget (as a fraction) the chosen, lowest plan reaches."""


@dataclass(frozen=True, kw_only=True)
class BudgetSpec:
    """A memory budget (ckpt_fx.policies.budget): not a per-node policy but a problem the pipeline
    solves over the whole graph (passes.pipeline._choose), its choice recorded in the Plan."""

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
    uses_blocks: bool = False

    def __call__(self, info) -> CheckpointPolicy:
        raise RuntimeError(f"{self.spec} decides over the whole graph: the pipeline solves it, not per node")

    def __repr__(self) -> str:
        return self.spec

    def candidates(self, gm: torch.fx.GraphModule, hard_rules: dict[str, str], *, fused: bool) -> Candidates:
        return Candidates(gm, hard_rules=hard_rules, grid=PLANNED_GRID if fused else BUDGET_GRID, solver=self.solver,
                          node_limit=self.node_limit, costs=self.costs, fused=fused)

    def chooser(self) -> Chooser:
        return Chooser(fraction=self.fraction, nbytes=self.nbytes, shown=self.shown)


# Saved-bytes fractions of the no-recompute plan at which a budget offers solver plans; fixed, so
# that every budget chooses from the same candidates (Note [Peak-aware budget]). Under min-cut the
# candidates are searched by bisection, a few planned however many there are, so the grid is finer.
BUDGET_GRID = (1.0, 0.75, 0.55, 0.4, 0.3, 0.22, 0.16, 0.12, 0.09, 0.065, 0.045, 0.03, 0.02, 0.01)
PLANNED_GRID = tuple(round(0.85**k, 4) for k in range(29))  # 1.0 down to 0.009


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One plan a budget offers: a per-node policy recomputing what its solution recomputes."""

    decisions: dict[str, CheckpointPolicy]
    solution: Solution
    recomputed: frozenset[str]
    """Names of the forward nodes it recomputes."""

    def __call__(self, info) -> CheckpointPolicy:
        return self.decisions[info.name]


class Candidates:
    """The plans a budget offers, most saved first (so least recompute first): the solver's plan at
    each of the grid's saved-bytes fractions of the no-recompute plan, then the plan that saves
    least; each solved when first asked for (`candidates[i]`), so a bisection over them solves few.
    Iterating gives the distinct ones in order. `costs` is "roofline" (Note [Roofline cost]) or
    "measured" (measured_costs); `fused`: planned for the min-cut partition under Inductor (fused
    pointwise costs, decisions(fused=True))."""

    def __init__(self, gm: torch.fx.GraphModule, *, hard_rules: dict[str, str], grid: tuple[float, ...], solver: str,
                 node_limit: int, costs: str = "roofline", fused: bool = False):
        from passes.solve import FRONT_SOLVES, pareto_front, parts_pay_off

        cost = measured_costs(graph_device(gm)) if costs == "measured" else None
        self.graph = build_problem(gm, hard_rules=hard_rules, cost=cost, fused=fused)
        self.grid, self.solver, self.node_limit, self.fused = grid, solver, node_limit, fused
        self.base = baseline_bytes(self.graph.problem)
        self._made: dict[int, Candidate] = {}
        # A problem in many alike parts (a stack of blocks) has its whole front found once; every
        # candidate is a point on it (Note [Independent parts]).
        self.front = None
        problem = self.graph.problem
        if solver == "parts" or (solver == "auto" and parts_pay_off(problem)):
            # Under auto, a front not found within FRONT_SOLVES exact solves gives way to one MILP per
            # candidate (a part with too many front points; Note [Plans bounded by counts]).
            self.front = pareto_front(problem, node_limit=node_limit,
                                      max_solves=math.inf if solver == "parts" else FRONT_SOLVES)
            if not self.front.exact and solver == "auto":
                self.front = None

    def __len__(self) -> int:
        return len(self.grid) + 1

    def __getitem__(self, i: int) -> Candidate:
        """The plan at the grid's i-th fraction (the last: the plan that saves least); a fraction
        below what any plan reaches gives the plan that saves least."""
        from passes.solve import Infeasible, smallest_budget

        if i not in self._made:
            problem = self.graph.problem
            least = i >= len(self.grid)
            try:
                if self.front is not None:
                    solution = self.front.solution(problem, self.front.nbytes[-1] if least else int(self.grid[i] * self.base))
                else:
                    budget = smallest_budget(problem) if least else int(self.grid[i] * self.base)
                    solution = solve(problem, budget, solver=self.solver, node_limit=self.node_limit,
                                     try_parts=False)  # parts were tried above
            except Infeasible:
                if least:
                    raise
                self._made[i] = self[len(self) - 1]
                return self._made[i]
            chosen = decisions(self.graph, solution, fused=self.fused)
            self._made[i] = Candidate(decisions=chosen, solution=solution, recomputed=frozenset(
                n for n, d in chosen.items() if d == CheckpointPolicy.MUST_RECOMPUTE))
        return self._made[i]

    def __iter__(self) -> Iterator[Candidate]:
        seen = set()
        for i in range(len(self)):
            candidate = self[i]
            key = (candidate.solution.saved, candidate.solution.recomputed)
            if key not in seen:
                seen.add(key)
                yield candidate


def recompute_cost(gm: torch.fx.GraphModule, names: tuple[str, ...] | list[str], *, fused: bool) -> float:
    """Roofline cost (Note [Roofline cost]) of recomputing the named forward nodes of a joint graph."""
    device = graph_device(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    return sum(roofline_cost(by_name[n], device, fused=fused) for n in names if n in by_name)


NOTHING_TO_LOWER = 0.01
"""A graph whose lowest plan keeps more than 1 - this of its peak above the gradients has nothing
to recompute that lowers it: a budget leaves it as it is, without a warning."""


class Chooser:
    """Judges planned candidates against the limit (Note [Peak-aware budget]): the first planned
    (no recompute) sets the baseline and the limit; `ceiling`, when set, is a peak no chosen plan
    may exceed besides the limit (torch's own plan's under Inductor)."""

    def __init__(self, *, fraction: float | None, nbytes: int | None, shown: str):
        self.fraction, self.nbytes, self.shown = fraction, nbytes, shown
        self.base: Estimate | None = None
        self.limit = 0
        self.peaks: list[int] = []
        self.ceiling: int | None = None

    def fits(self, plan: Estimate) -> bool:
        """Whether a plan's predicted peak fits the limit and the ceiling; the first plan judged
        is the baseline the limit counts from."""
        if self.base is None:
            self.base = plan
            floor = plan.gradient_bytes
            span = max(plan.peak_bytes - floor, 1)
            self.limit = int(floor + self.fraction * span) if self.fraction is not None else int(self.nbytes or 0)
        self.peaks.append(plan.peak_bytes)
        return plan.peak_bytes <= self.limit and (self.ceiling is None or plan.peak_bytes <= self.ceiling)

    def choice(self, peak: int, *, cost: float, solver: str) -> Choice:
        """The Choice recording a plan of this peak and recompute cost."""
        return Choice(
            limit_bytes=self.limit, baseline_peak=self.base.peak_bytes, smallest_peak=min(self.peaks),
            peak=peak, cost=cost, solver=solver, candidates=len(self.peaks),
        )

    def accept(self, plan: Estimate, candidate) -> Choice | None:
        """The Choice for a candidate whose plan fits, else None."""
        if not self.fits(plan):
            return None
        return self.choice(plan.peak_bytes, cost=candidate.solution.cost, solver=candidate.solution.solver)

    def reject(self, first_cost: float, first_solver: str, lowest_peak: int, lowest_cost: float,
               lowest_solver: str) -> tuple[Choice, Exception | None]:
        """No plan fitted. When none lowers the peak by more than NOTHING_TO_LOWER of what it
        could (a graph with nothing to recompute, such as a loss after a graph break; predicted
        peaks of plans that differ in a few small recomputes differ by bytes): the first (no
        recompute), no error. Else the plan with the lowest predicted peak, and the Infeasible
        error naming the budget it reaches: raised under strict, a warning otherwise (as torch's
        budget knob, the compile goes on with the lowest plan)."""
        from passes.solve import Infeasible

        smallest = min(self.peaks)
        floor = self.base.gradient_bytes
        span = max(self.base.peak_bytes - floor, 1)
        least = (smallest - floor) / span
        if least >= 1 - NOTHING_TO_LOWER:
            return self.choice(self.base.peak_bytes, cost=first_cost, solver=first_solver), None
        error = Infeasible(
            self.limit,
            smallest,
            f"budget {self.shown} is infeasible for this graph: it allows a peak of {self.limit / 2**20:.2f} MiB, "
            f"the lowest any plan reaches is {smallest / 2**20:.2f} MiB (budget {least:.3f} as a fraction, "
            f"or '{smallest / 2**20:.1f}MiB')",
        )
        choice = dataclasses.replace(self.choice(lowest_peak, cost=lowest_cost, solver=lowest_solver), reached=least)
        return choice, error
