"""budget: a memory budget's plan for a joint graph. The graph as a recompute Problem
(passes.solve; build_problem) and a solution back into recompute decisions; the candidate plans a
budget offers (Candidates); the search that plans them and a Chooser that judges them by their
predicted peaks (choose). The choice is recorded in the graph's Plan (Plan.budget).

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

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from passes._compat import CheckpointPolicy, activation_memory_budget, offload_bandwidth
from passes.costs import agreed_costs, graph_device, is_multi_output, is_view, measured_costs, recompute_cost, roofline_cost, BYTES_KEY
from passes.graphs import forward_nodes
from passes.memory import JointLiveness
from passes.offload import offloadable
from passes.plan import Choice, Estimate, Planned, Source
from passes.planner import Joint, plan_policy, scheduled_whole
from passes.policy import BudgetSpec
from passes.regions import RegionKind, region_of
from passes.select import Reason
from passes.sizes import format_size, size_literal
from passes.solve import FRONT_SOLVES, Infeasible, Problem, Solution, pareto_front, parts_pay_off, save_all, smallest_budget, solve
from passes.warn import BudgetWarning, warn_user

# Note [Peak-aware budget]
# The saved bytes a solver bounds are not the peak: recomputation rebuilds values that then live
# until their backward. So budget() plans a fixed set of candidates (the solver's plans at fixed
# fractions of the no-recompute saved bytes, then the plan that saves least), predicts each one's
# step peak and picks the cheapest whose peak fits the limit. Under the default partition every
# candidate's peak comes from the joint graph (JointLiveness), most saved first until one fits.
# Under min-cut a peak needs the candidate partitioned and Inductor's schedule of it (seconds for
# a large graph), so the cheapest fitting one is found by a search over the candidates that plans
# few (the first the one the line through the baseline and torch's plan puts at the limit, then
# interpolating on saved bytes, bisecting where that does not pay, next to a fitting one
# that peaks near the limit planning the one before it), their peaks falling as
# they save less (a search over peaks that do not fall may pick a costlier plan that fits, never
# one that does not); torch's own plan at the same budget takes part (Note [Torch's knob as a
# candidate]), and when it fits, the candidates that cannot cost less than it are not planned. The candidates do not depend on the limit, so a lower limit picks
# either the same plan (it still fits and is still the cheapest) or one whose peak is below the
# new limit, hence below the old pick's: the predicted peak never rises as the limit falls. (With
# torch's plan taking part that holds for ours: torch's knob is not monotone, and where its plan at
# a higher budget is leaner than our limit at a lower one, the higher budget keeps less.)


# Saved-bytes fractions of the no-recompute plan at which a budget offers solver plans; fixed, so
# that every budget chooses from the same candidates (Note [Peak-aware budget]). Under min-cut the
# candidates are searched (_search), a few planned however many there are, so the grid is finer.
BUDGET_GRID = (1.0, 0.75, 0.55, 0.4, 0.3, 0.22, 0.16, 0.12, 0.09, 0.065, 0.045, 0.03, 0.02, 0.01)
PLANNED_GRID = tuple(round(0.85**k, 4) for k in range(29))  # 1.0 down to 0.009

# The search's other tunables: each trades plans partitioned (seconds each under Inductor) for a
# plan nearer the cheapest, or a warning for a plan that changes nothing.
NEAR = 0.05
"""How near the limit a fitting candidate's peak must be for the one before it (saving more, so
cheaper to run) to be planned next (_cheapest_fitting): one partition more for a cheaper plan."""
LOWEST_SEARCH = 6
"""Distinct plans _lowest_from_the_end partitions at most, each costing a partition and
Inductor's schedule: more finds a lower lowest plan where nothing fits, slower."""
NEIGHBOUR = 0.05
"""How much more a candidate must save than the last one _lowest_from_the_end planned to be
planned: a few small values apart peak about alike, not worth a partition."""
PLATEAU = 0.01
"""How far above the lowest peak so far a plan saving more may peak while _lowest_from_the_end
goes on looking (past the lowest, a plan that saves less can peak higher): a wider plateau plans
more, and may find a lower plan further on."""
BLOCKWISE_ERROR = 0.10
"""How far above the limit the peak of torch's plan, its backward scheduled block by block, must
be for the plan to be out of reach without its whole backward's schedule (Note [Torch's plan
beyond reach]): lower schedules torch's plan whole less often, and may leave out one that fits."""
NOTHING_TO_LOWER = 0.01
"""A graph whose lowest plan keeps more than 1 - this of its peak above the gradients has nothing
to recompute that lowers it: a budget leaves it as it is, without a warning."""


@dataclass(frozen=True)
class Graph:
    """A Problem and the nodes its values stand for."""

    problem: Problem
    nodes: tuple[torch.fx.Node, ...]
    boundaries: frozenset[int] = frozenset()
    """Values crossing a block's edge (Note [Block boundaries under a budget])."""


def build_problem(
    gm: torch.fx.GraphModule,
    *,
    hard_rules: dict[str, Reason],
    costs: str = "roofline",
    fused: bool = False,
    bandwidth: float | None = None,
    num_fwd_outputs: int | None = None,
    device: str | None = None,
) -> Graph:
    """The recompute Problem of a joint graph whose nodes carry regions and costs. `costs`:
    "roofline" (Note [Roofline cost] in passes/costs.py; `fused` prices the ops Inductor fuses as
    their extra reads) or "measured" (each op timed; rank 0's timings under a process group).
    `bandwidth` (bytes per second), when given, lets the values torch's offload pass can move be
    offloaded, a copy priced at its bytes over it (Note [Offload in the recompute problem] in
    passes/solve.py); the first `num_fwd_outputs` outputs of the joint graph are the user's and
    stay. `device`: the device type to price for (default: the graph's)."""
    device = device or graph_device(gm)
    user_outputs = set(gm.graph.output_node().args[0][:num_fwd_outputs]) if num_fwd_outputs is not None else set()
    cost = measured_costs(device) if costs == "measured" else (lambda n: roofline_cost(n, device, fused=fused))
    fwd = forward_nodes(gm.graph)
    fwd_set = set(fwd)
    nodes = tuple(n for n in fwd if n.op == "call_function")
    index = {n: i for i, n in enumerate(nodes)}
    names, nbytes, prices, inputs, needed, saveable, recomputable = [], [], [], [], [], [], []
    movable, transfer, group = [], [], []
    for node in nodes:
        names.append(node.name)
        view_or_tuple = is_view(node) or is_multi_output(node) or isinstance(node.meta.get("val"), (tuple, list))
        nbytes.append(0 if view_or_tuple else node.meta.get(BYTES_KEY, 0))
        prices.append(cost(node))
        inputs.append(tuple(sorted({index[a] for a in node.all_input_nodes if a in index})))
        needed.append(any(u not in fwd_set and u.op != "output" for u in node.users))
        saveable.append(not view_or_tuple)
        region = region_of(node)
        recomputable.append(node.name not in hard_rules and not (region is not None and region.kind == RegionKind.EMBEDDING))
        # Hard-ruled values are saved before any policy is asked (select_pass): not the plan's to move.
        movable.append(bandwidth is not None and not view_or_tuple and node.name not in hard_rules
                       and offloadable(node, user_outputs=user_outputs))
        transfer.append(nbytes[-1] / bandwidth if bandwidth else 0.0)
        block = _block_of(node)
        group.append(block.number if block is not None else -1)
    edges = _boundaries(nodes, index, saveable)
    for i in edges:
        recomputable[i] = False
        needed[i] = True  # always saved: the blocks are then independent parts
    if costs == "measured":  # timings differ between ranks, plans must not
        prices = agreed_costs(tuple(names), tuple(prices))
    problem = Problem(
        names=tuple(names), nbytes=tuple(nbytes), cost=tuple(prices), inputs=tuple(inputs),
        needed=tuple(needed), saveable=tuple(saveable), recomputable=tuple(recomputable),
        offloadable=tuple(movable), transfer=tuple(transfer), group=tuple(group),
    )
    return Graph(problem=problem, nodes=nodes, boundaries=frozenset(edges))


def _block_of(node: torch.fx.Node) -> object | None:
    region = region_of(node)
    return region.block if region is not None and region.kind == RegionKind.BLOCK else None


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
    """MUST_RECOMPUTE for recomputed values; MUST_CPU_OFFLOAD for offloaded ones; MUST_SAVE for
    saved ones; PREFER_SAVE for the rest (values the backward never reads).

    `fused` (min-cut partition, Note [Min-cut under Inductor]): only block edges are MUST_SAVE, and
    only when the plan recomputes something; the other saved values are PREFER_SAVE, so min-cut may
    still recompute the cheap fusible ones, as Inductor alone would. A plan that recomputes nothing
    is then exactly Inductor's own partition."""
    out = {}
    for i, node in enumerate(graph.nodes):
        if i in solution.recomputed:
            out[node.name] = CheckpointPolicy.MUST_RECOMPUTE
        elif i in solution.offloaded:
            out[node.name] = CheckpointPolicy.MUST_CPU_OFFLOAD
        elif i in solution.saved and (not fused or (solution.recomputed and i in graph.boundaries)):
            out[node.name] = CheckpointPolicy.MUST_SAVE
        else:
            out[node.name] = CheckpointPolicy.PREFER_SAVE
    return out


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One plan a budget offers: a per-node policy recomputing what its solution recomputes."""

    decisions: dict[str, CheckpointPolicy]
    solution: Solution
    recomputed: frozenset[str]
    """Names of the forward nodes it recomputes."""
    offloaded: frozenset[str] = frozenset()
    """Names of the forward nodes whose values it keeps in host memory."""

    def __call__(self, info) -> CheckpointPolicy:
        return self.decisions[info.name]


class Candidates:
    """The plans a budget offers, most saved first (so least recompute first): the solver's plan at
    each of the grid's saved-bytes fractions of the no-recompute plan, then the plan that saves
    least; each solved when first asked for (`candidates[i]`), so a search over them solves few.
    Iterating gives the distinct ones in order. `costs` is "roofline" (Note [Roofline cost]) or
    "measured" (measured_costs); `fused`: planned for the min-cut partition under Inductor (fused
    pointwise costs, decisions(fused=True))."""

    def __init__(self, gm: torch.fx.GraphModule, *, hard_rules: dict[str, Reason], grid: tuple[float, ...], solver: str,
                 node_limit: int, costs: str = "roofline", fused: bool = False, bandwidth: float | None = None,
                 num_fwd_outputs: int | None = None, device: str | None = None):
        self.graph = build_problem(gm, hard_rules=hard_rules, costs=costs, fused=fused, bandwidth=bandwidth,
                                   num_fwd_outputs=num_fwd_outputs, device=device)
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
            if not self.front.exact and solver == "auto" and not problem.offloads():
                self.front = None  # with offload the parts' front stands (Note [Offload in the recompute problem])

    def __len__(self) -> int:
        return len(self.grid) + 1

    def __getitem__(self, i: int) -> Candidate:
        """The plan at the grid's i-th fraction (the last: the plan that saves least); a fraction
        below what any plan reaches gives the plan that saves least."""
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
            self._made[i] = Candidate(
                decisions=chosen, solution=solution,
                recomputed=frozenset(n for n, d in chosen.items() if d == CheckpointPolicy.MUST_RECOMPUTE),
                offloaded=frozenset(n for n, d in chosen.items() if d == CheckpointPolicy.MUST_CPU_OFFLOAD))
        return self._made[i]

    def __iter__(self) -> Iterator[Candidate]:
        seen = set()
        for i in range(len(self)):
            candidate = self[i]
            key = (candidate.solution.saved, candidate.solution.recomputed, candidate.solution.offloaded)
            if key not in seen:
                seen.add(key)
                yield candidate

    @classmethod
    def of(cls, spec: BudgetSpec, joint: Joint, hard_rules: dict[str, Reason]) -> Candidates:
        """The candidates a budget offers for a joint graph, priced and decided for its target:
        on the finer grid under Inductor, whose candidates are searched by _search (Note
        [Peak-aware budget]); with offload, priced at the spec's bandwidth or torch's."""
        fused = joint.target.fuses
        bandwidth = (spec.bandwidth or offload_bandwidth()) if spec.offload else None
        return cls(joint.gm, hard_rules=hard_rules, grid=PLANNED_GRID if fused else BUDGET_GRID, solver=spec.solver,
                   node_limit=spec.node_limit, costs=spec.costs, fused=fused, bandwidth=bandwidth,
                   num_fwd_outputs=joint.num_fwd_outputs, device=joint.device)


class Chooser:
    """Judges candidate plans against a budget's limit (Note [Peak-aware budget]). `base` is the
    plan that recomputes nothing: the limit counts from it. `ceiling`, when given, is a peak no
    chosen plan may exceed besides the limit (torch's own plan's under Inductor)."""

    def __init__(self, spec: BudgetSpec, *, base: Estimate, ceiling: int | None = None):
        self.spec, self.base, self.ceiling = spec, base, ceiling
        floor = base.gradient_bytes
        span = max(base.peak_bytes - floor, 1)
        self.limit = int(floor + spec.fraction * span) if spec.fraction is not None else int(spec.nbytes or 0)
        self.peaks: list[int] = []

    def with_ceiling(self, ceiling: int) -> Chooser:
        """The same judge with a ceiling, and the peaks judged so far."""
        judge = Chooser(self.spec, base=self.base, ceiling=ceiling)
        judge.peaks = list(self.peaks)
        return judge

    def fits(self, plan: Estimate) -> bool:
        """Whether a plan's predicted peak fits the limit and the ceiling; counts it as judged."""
        self.peaks.append(plan.peak_bytes)
        return plan.peak_bytes <= self.limit and (self.ceiling is None or plan.peak_bytes <= self.ceiling)

    def choice(self, peak: int, *, cost: float, source: Source, solver: str | None = None,
               reached: float | None = None) -> Choice:
        """The Choice recording a plan of this peak and recompute cost."""
        return Choice(
            limit_bytes=self.limit, baseline_peak=self.base.peak_bytes, smallest_peak=min(self.peaks, default=self.base.peak_bytes),
            peak=peak, cost=cost, source=source, solver=solver if source == Source.SOLVER else None,
            candidates=len(self.peaks), reached=reached,
        )

    def nothing_to_lower(self) -> bool:
        """No plan judged lowers the peak by more than NOTHING_TO_LOWER of what it could (a graph
        with nothing to recompute, such as a loss after a graph break; predicted peaks of plans that
        differ in a few small recomputes differ by bytes)."""
        return self.reached() >= 1 - NOTHING_TO_LOWER

    def reached(self) -> float:
        """The lowest peak judged, as a fraction of the span from the gradients to the baseline."""
        floor = self.base.gradient_bytes
        return (min(self.peaks, default=self.base.peak_bytes) - floor) / max(self.base.peak_bytes - floor, 1)

    def infeasible(self) -> Infeasible:
        """The error naming the budget the lowest plan reaches: raised under strict, a warning
        otherwise (as torch's budget knob, the compile goes on with the lowest plan)."""
        smallest, least = min(self.peaks), self.reached()
        return Infeasible(
            self.limit,
            smallest,
            f"budget {self.spec.shown} is infeasible for this graph: it allows a peak of {format_size(self.limit)}, "
            f"the lowest any plan reaches is {format_size(smallest)} (budget {least:.3f} as a fraction, "
            f"or '{size_literal(smallest, up=True)}')",
            reached=least,
        )


def choose(joint: Joint, spec: BudgetSpec, *, hard_rules: dict[str, Reason], strict: bool) -> tuple[Planned, Choice]:
    """A memory budget's plan of a joint graph and the choice that made it. A budget offers
    several candidate plans and picks one by their predicted peaks (Note [Peak-aware budget]):
    for the eager target by walking the joint graph (_by_walk), for Inductor, whose min-cut
    partition adds recomputes of its own, by planning them (_by_planning). When none fits: the
    lowest, with a warning naming the budget it reaches (an Infeasible error under strict); when
    none lowers the peak at all, the graph as it is."""
    search = _by_planning if joint.target.fuses else _by_walk
    planned, choice, error = search(joint, spec, hard_rules)
    if error is not None:
        if strict:
            raise error
        warn_user(f"ckpt_fx: {error}; planned the lowest", BudgetWarning)
    return planned, choice


def _by_walk(joint: Joint, spec: BudgetSpec, hard_rules: dict[str, Reason]) -> tuple[Planned, Choice, Infeasible | None]:
    """Under the default partition: each candidate's peak predicted from the joint graph (Note
    [Peak from the joint graph] in passes/memory.py), most saved first, until one fits; only that
    one is partitioned. The first candidate saves every value: the baseline the limit counts from."""
    steps, gm = joint.steps, joint.gm
    liveness = steps.run("memory", lambda: JointLiveness(
        gm, num_fwd_outputs=joint.num_fwd_outputs, static_input_indices=joint.static_lifetime_input_indices))
    offered = iter(steps.run("solve", lambda: Candidates.of(spec, joint, hard_rules)))
    chooser: Chooser | None = None
    first = lowest = None
    lowest_peak = 0
    while (candidate := steps.run("solve", lambda: next(offered, None))) is not None:
        estimate = steps.run("memory", lambda: liveness.estimate(candidate.recomputed, candidate.offloaded))
        if chooser is None:
            first, chooser = candidate, Chooser(spec, base=estimate)
        if lowest is None or estimate.peak_bytes < lowest_peak:
            lowest, lowest_peak = candidate, estimate.peak_bytes
        if chooser.fits(estimate):
            choice = chooser.choice(estimate.peak_bytes, cost=candidate.solution.cost, source=Source.SOLVER,
                                    solver=candidate.solution.solver)
            return plan_policy(joint, candidate), choice, None
    if chooser.nothing_to_lower():
        choice = chooser.choice(chooser.base.peak_bytes, cost=first.solution.cost, source=Source.SOLVER,
                                solver=first.solution.solver)
        return plan_policy(joint, first), choice, None
    error = chooser.infeasible()
    choice = chooser.choice(lowest_peak, cost=lowest.solution.cost, source=Source.SOLVER, solver=lowest.solution.solver,
                            reached=error.reached)
    return plan_policy(joint, lowest), choice, error


@dataclass
class _Entry:
    """One distinct plan a budget's search under Inductor partitioned."""

    planned: Planned
    solver: str | None
    """The solver whose candidate it is (Choice.solver)."""
    fits: bool | None = None
    """Its verdict against the limit, once judged."""


class _Books:
    """What a budget's search under Inductor has planned (_by_planning): each distinct candidate
    partitioned once, by its decisions, with the solver that found it, and judged once (a
    Choice's `candidates` counts distinct plans). A candidate that decides nothing is the base."""

    def __init__(self, joint: Joint, offered: Candidates, base: Planned):
        self.joint, self.offered = joint, offered
        self.base = _Entry(base, None)
        self.entries: dict[tuple, _Entry] = {}

    def entry(self, i: int) -> _Entry:
        candidate = self.joint.steps.run("solve", lambda: self.offered[i])
        if not candidate.recomputed and not candidate.offloaded:
            return self.base
        key = (candidate.solution.saved, candidate.solution.recomputed, candidate.solution.offloaded)
        if key not in self.entries:
            self.entries[key] = _Entry(plan_policy(self.joint, candidate), candidate.solution.solver)
        return self.entries[key]

    def plan(self, i: int) -> Planned:
        """Candidate i, partitioned (once)."""
        return self.entry(i).planned

    def fits(self, i: int, chooser: Chooser) -> bool:
        """Whether candidate i's plan fits the chooser's limit, judged once per plan."""
        entry = self.entry(i)
        if entry.fits is None:
            entry.fits = chooser.fits(entry.planned.prediction.estimate())
        return entry.fits

    def planned(self) -> list[Planned]:
        """Every plan partitioned from a candidate that decides anything, in the order planned."""
        return [entry.planned for entry in self.entries.values()]

    def entry_of(self, planned: Planned) -> _Entry | None:
        """The entry of a plan partitioned from a candidate that decides anything, or None."""
        return next((entry for entry in self.entries.values() if entry.planned is planned), None)


def _by_planning(joint: Joint, spec: BudgetSpec, hard_rules: dict[str, Reason]) -> tuple[Planned, Choice, Infeasible | None]:
    """Under min-cut, which adds recomputes of its own, a candidate's peak is known only once it is
    partitioned (the memory pass reads it from Inductor's schedule), so few are: Inductor's own
    partition (the baseline the limit counts from), torch's plan at the same budget (Note [Torch's
    knob as a candidate]), then the cheapest of ours that fits (_search; the candidates save less
    and less: their peaks fall along them), among those that could cost less than torch's plan
    when that fits. The cheaper of ours and torch's is chosen, torch's only when it fits the limit."""
    steps, gm = joint.steps, joint.gm

    def cost(planned: Planned) -> float:
        return recompute_cost(gm, planned.prediction.recomputed, fused=joint.target.fuses)

    base = plan_policy(joint, _leave_open)  # what Inductor alone does: nothing recomputed by us
    chooser = Chooser(spec, base=base.prediction.estimate())
    found: Planned | None = base if chooser.fits(base.prediction.estimate()) else None
    torch_plan = knob = None
    whole = True  # torch's plan's peak from Inductor's schedule of its whole backward
    if spec.fraction is not None:
        with activation_memory_budget(spec.fraction):
            torch_plan = plan_policy(joint, _leave_open, by_block=True)
        # Note [Torch's plan beyond reach]
        whole = _within_reach(torch_plan, chooser.limit)
        if whole:
            torch_plan = scheduled_whole(joint, torch_plan)
        if whole and chooser.fits(torch_plan.prediction.estimate()):  # else over the limit: not a choice, and no ceiling on ours
            knob = torch_plan
            chooser = chooser.with_ceiling(knob.prediction.peak_bytes)
            if found is not None and base.prediction.peak_bytes > chooser.ceiling:
                found = None
    offered = steps.run("solve", lambda: Candidates.of(spec, joint, hard_rules))
    books = _Books(joint, offered, base)

    if found is None:
        limit = chooser.limit if chooser.ceiling is None else min(chooser.limit, chooser.ceiling)
        saved = lambda i: base.prediction.saved_bytes if i < 0 else offered[i].solution.saved_bytes  # noqa: E731
        peak = lambda i: (base if i < 0 else books.plan(i)).prediction.peak_bytes  # noqa: E731
        point = (torch_plan.prediction.saved_bytes, torch_plan.prediction.peak_bytes) if torch_plan is not None else None
        index = _search(len(offered), fits=lambda i: books.fits(i, chooser), saved=saved, peak=peak,
                        same=lambda i, j: books.plan(i) is books.plan(j), limit=limit, torch_point=point,
                        affordable=_affordable(offered, gm, cost(knob)) if knob is not None else len(offered))
        found = books.plan(index) if index is not None else None
    if found is None and torch_plan is not None and not whole:
        # None of ours fits. Torch's plan cannot either; where it may be the lowest plan, it is
        # judged as ours are, by its whole backward's schedule; else it takes no part.
        lowest_ours = min((p.prediction.peak_bytes for p in books.planned()), default=base.prediction.peak_bytes)
        if _within_reach(torch_plan, lowest_ours):
            torch_plan = scheduled_whole(joint, torch_plan)
            if chooser.fits(torch_plan.prediction.estimate()):
                knob = torch_plan
        else:
            torch_plan = None
    if knob is not None and (found is None or cost(knob) < cost(found)):
        found = knob
    if found is not None:
        return found, _choice_of(chooser, found, cost(found), knob=knob, books=books), None
    # Nothing fits: the lowest plan, with the budget it reaches; or, when no plan lowers this
    # graph's peak at all (nothing in it to recompute), the graph as it is.
    tried = books.planned() + ([torch_plan] if torch_plan is not None else [])
    lowest_plan = min(tried, key=lambda p: p.prediction.peak_bytes, default=base)
    if chooser.nothing_to_lower():
        return base, chooser.choice(base.prediction.peak_bytes, cost=0.0, source=Source.UNCHANGED), None
    error = chooser.infeasible()
    choice = _choice_of(chooser, lowest_plan, cost(lowest_plan), knob=torch_plan, books=books, reached=error.reached)
    return lowest_plan, choice, error


def _search(count: int, *, affordable: int, fits: Callable[[int], bool], saved: Callable[[int], int],
            peak: Callable[[int], int], same: Callable[[int, int], bool], limit: int,
            torch_point: tuple[int, int] | None = None) -> int | None:
    """The position of the cheapest of the first `affordable` of `count` candidates that fits, or
    None. `saved(i)`/`peak(i)`: candidate i's saved bytes and predicted peak (i = -1: the
    baseline, which does not fit; a peak plans the candidate), `same(i, j)`: whether two positions
    are one plan; `torch_point`: torch's plan's saved bytes and peak, for aiming.
    The first candidate planned is the one the line through the baseline and torch's plan puts nearest
    the limit (_aimed); when that misses the limit by less than NEAR, the one after it, which fits
    most likely and then is the first that does; the last affordable one otherwise. Between one
    that does not fit and one that does, the cheapest is found by interpolation
    (_cheapest_fitting); when none fits and all are affordable, from the lowest found from the end
    (_lowest_from_the_end); when only some are, none of them fits (their peaks fall along them)."""
    if affordable <= 0:
        return None
    end, low = affordable - 1, -1
    aimed = _aimed(end, saved=saved, peak=peak, limit=limit, torch_point=torch_point)
    if aimed is not None and aimed < end:
        if fits(aimed):
            return _cheapest_fitting(-1, aimed, fits=fits, saved=saved, peak=peak, limit=limit, torch_point=torch_point)
        low = aimed
        if peak(aimed) <= (1 + NEAR) * limit and not same(aimed, aimed + 1):
            # Missed by a little: the next one (saving less) most likely fits, and then decides.
            if fits(aimed + 1):
                return aimed + 1
            low = aimed + 1
    if not fits(end):
        if affordable < count:
            return None
        end = _lowest_from_the_end(count, peak=peak, saved=saved, same=same)
        if not fits(end):
            return None
        low = low if low < end else -1
    return _cheapest_fitting(low, end, fits=fits, saved=saved, peak=peak, limit=limit, torch_point=torch_point)


def _aimed(end: int, *, saved: Callable[[int], int], peak: Callable[[int], int], limit: int,
           torch_point: tuple[int, int] | None) -> int | None:
    """The candidate, of those up to `end`, whose saved bytes the line through the baseline (-1)
    and torch's plan puts nearest the limit; None without such a line (no plan of torch's, or one
    that saves no less or peaks no lower than the baseline)."""
    if torch_point is None:
        return None
    (x_torch, p_torch), x_base, p_base = torch_point, saved(-1), peak(-1)
    if not (x_torch < x_base and p_torch < p_base):
        return None
    target = x_torch + (limit - p_torch) * (x_base - x_torch) / (p_base - p_torch)
    return _nearest(0, end, target, saved=saved)


def _nearest(lo: int, hi: int, target: float, *, saved: Callable[[int], int]) -> int:
    """The candidate in [lo, hi] whose saved bytes are nearest `target` (they fall along the
    candidates): the first saving no more than it, or the one before that when nearer."""
    first, last = lo, hi
    while lo < hi:
        mid = (lo + hi) // 2
        if saved(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1 if lo - 1 >= first and saved(lo - 1) - target < target - saved(lo) else min(lo, last)


def _cheapest_fitting(low: int, high: int, *, fits: Callable[[int], bool], saved: Callable[[int], int],
                      peak: Callable[[int], int], limit: int, torch_point: tuple[int, int] | None = None) -> int:
    """The first candidate that fits between `low` (does not fit; -1: the baseline) and `high`
    (fits). A candidate's peak falls about linearly with the bytes it saves, so each step plans the
    one whose saved bytes the line through the two ends puts nearest the limit (through torch's
    plan's point between them and the end on the limit's other side, where there is one); once a
    fitting one peaks within NEAR of the limit, the one before it (saving more) is planned next, as
    it most likely decides (not twice in a row); and a step that did not halve the interval is
    followed by a halving (a curve far from a line): a bisection's answer, in fewer plans."""
    halve = stepped = False
    while high - low > 1:
        middle = (low + high) // 2
        step = not stepped and peak(high) >= (1 - NEAR) * limit
        if step:
            middle = high - 1
        elif not halve:
            x_low, x_high, p_low, p_high = saved(low), saved(high), peak(low), peak(high)
            if torch_point is not None:
                x, p = torch_point
                if x_high < x < x_low and p_high < p < p_low:
                    if p <= limit:
                        x_high, p_high = x, p
                    else:
                        x_low, p_low = x, p
            if p_low > p_high and x_low > x_high:
                target = x_high + (limit - p_high) * (x_low - x_high) / (p_low - p_high)
                middle = _nearest(low + 1, high - 1, target, saved=saved)
        width = high - low
        stepped = step
        if fits(middle):
            high = middle
        else:
            low = middle
        halve = not halve and 2 * (high - low) > width
    return high


def _affordable(offered: Candidates, gm: torch.fx.GraphModule, bound: float) -> int:
    """How many candidates, from the first, could cost less than `bound` (torch's plan's cost):
    a candidate's partition recomputes at least what it decides, so what it decides prices it from
    below, and that price rises along the candidates. Found by bisection (each position solved
    when first asked for)."""
    lo, hi = 0, len(offered)
    while lo < hi:
        mid = (lo + hi) // 2
        if recompute_cost(gm, offered[mid].recomputed, fused=offered.fused) < bound:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _choice_of(chooser: Chooser, planned: Planned, cost: float, *, knob: Planned | None, books: _Books,
               reached: float | None = None) -> Choice:
    """The Choice of a plan the min-cut search picked: torch's, a solver's, or Inductor's own."""
    entry = books.entry_of(planned)
    if planned is knob:
        source, solver = Source.TORCH_KNOB, None
    elif entry is not None:
        source, solver = Source.SOLVER, entry.solver
    else:
        source, solver = Source.UNCHANGED, None
    return chooser.choice(planned.prediction.peak_bytes, cost=cost, source=source, solver=solver, reached=reached)


def _lowest_from_the_end(count: int, *, peak: Callable[[int], int], saved: Callable[[int], int],
                         same: Callable[[int, int], bool]) -> int:
    """The candidate of lowest predicted peak, looked for from the one that saves least towards
    those that save more while the peak does not rise by more than PLATEAU (past the lowest, a
    plan that saves less can peak higher: it rebuilds more at once), at most LOWEST_SEARCH distinct
    plans, passing over those that save less than NEIGHBOUR more than the last one planned (a
    few small values apart: about its peak); returns its position (of those as low, the one that
    saves most: the cheapest)."""
    best = last = count - 1
    tried, i = 1, best - 1
    while i >= 0 and tried < LOWEST_SEARCH:
        if saved(i) >= (1 + NEIGHBOUR) * saved(last) and not same(i, best):
            tried, last = tried + 1, i
            if peak(i) > (1 + PLATEAU) * peak(best):
                break
            if peak(i) <= peak(best):
                best = i
        i -= 1
    return best


def _within_reach(torch_plan: Planned, peak: int) -> bool:
    """Whether torch's plan, its backward scheduled block by block, peaks within BLOCKWISE_ERROR
    of `peak`: only then may its whole schedule's peak be at or under it (Note [Torch's plan
    beyond reach])."""
    return torch_plan.prediction.peak_bytes <= (1 + BLOCKWISE_ERROR) * peak


def _leave_open(info) -> CheckpointPolicy:
    """Every decision left to the partitioner (torch's own plan)."""
    return CheckpointPolicy.PREFER_SAVE


# Note [Torch's knob as a candidate]
# Under Inductor, torch's activation_memory_budget=x plans with the min-cut partitioner too, by
# its own rules (a knapsack over the ops min-cut would not recompute), and our hard rules still
# hold in it (random ops, mutations are tagged MUST_SAVE before min-cut sees them). budget:x plans
# torch's plan at the same x; when its predicted peak fits our limit, that peak is a ceiling for
# ours, and torch's plan is itself a choice: the cheaper (recompute cost, Note [Roofline cost], of
# what each partition recomputes) of it and our cheapest candidate under the ceiling is used
# (Choice.source == Source.TORCH_KNOB when torch's). So budget:x keeps no more than torch's knob
# at x where that fits x's limit, and costs no more by our cost model. This needs the peaks
# predicted as Inductor runs the plans (Note [Inductor's own schedule]): predicted by the walk's
# own guess of fusion, torch's aggressive pointwise recompute looks far leaner than it is, and was
# chosen over plans that measured lower.


# Note [Torch's plan beyond reach]
# Torch's plan asks min-cut for recomputes after its CSE, so its peak comes from Inductor's
# schedule of its whole backward (Note [Whole backward schedules] in passes/planner.py), the
# costliest schedule of a budget's search. Scheduled block by block instead, its peak was 0.87x to
# 1.07x the whole schedule's on eight decoders and encoders at 0.7, 0.5 and 0.3. So torch's plan is scheduled block by block first; where that peak is more than
# BLOCKWISE_ERROR above the limit, the whole schedule's cannot fit either, and the plan serves
# only to aim the search (its saved bytes and that peak) and is neither a choice nor a ceiling;
# nearer the limit its whole backward is scheduled and decides. When none of ours fits, the
# lowest plan is picked: torch's takes part, scheduled whole, where its peak block by block is
# within BLOCKWISE_ERROR of our lowest (it can be the lowest, as on an MoE model far below its
# budget), and no part above that.
