"""Solvers for the memory-budget policy: which forward values to save so that the saved bytes fit a
budget and the recompute cost is least. Plain data in, plain data out: no fx here.

Note [The recompute problem]
A Problem lists forward values in topological order. Value i costs `cost[i]` to compute (seconds,
from a roofline of its FLOPs and bytes) and occupies `nbytes[i]` when saved; it is computed from
`inputs[i]` (other values of the problem; graph inputs and parameters are always at hand and are
not listed). `needed[i]` says the backward reads it. A plan saves some values (S) and recomputes
others (R) in the backward, such that
    every needed value is saved or recomputed                    needed[i] => i in S or i in R
    a recomputed value's inputs are saved or recomputed          i in R, j in inputs[i] => j in S or j in R
    values that cannot be saved (views, tuples) are not saved    not saveable[i] => i not in S
    values that must not run twice (random, mutating) are not recomputed
    the saved bytes fit the budget                              sum(nbytes[S]) <= budget
and it minimises sum(cost[R]) (then the saved bytes, to break ties). Every solver takes
(problem, budget) and returns a Solution; one table of cases runs against all of them.
  - chain_dp: exact, for chains (each value's inputs are at most its predecessor): a dynamic
    programme over positions that keeps the Pareto front of (saved bytes, cost) per state.
  - milp: exact for any graph, scipy's HiGHS MILP under a time limit (optimal=False if cut short).
  - greedy: any graph, fast: drops saved values cheapest-to-recompute-per-byte first.
  - by_parts ("parts"): exact for any graph, through its independent parts (Note [Independent
    parts]); fast when the parts are small and alike (a model's blocks).
A saved value may also be offloaded (Note [Offload in the recompute problem]): the MILP (and the
parts through it) chooses among the three; chain_dp and greedy plan without offloading.

Note [Offload in the recompute problem]
An offloaded value is saved in host memory: it is at hand for the backward and for recomputes as
a saved one is (so plans keep it in S), but its bytes do not count against the device budget;
the copies out and back cost time (`transfer[i]` seconds each way) unless compute hides them. The
model of that (passes/offload.py, Note [Offload]): the copies of a unit's offloaded values run
beside the next unit's forward, and their copies back beside the backward of the unit after it;
a unit's compute time is the sum of `cost` over its values (`group[i]` names the unit, -1 none).
So with T the transfer time of unit g's offloaded values and W its compute time, the time the
copies add is max(0, T - W) + max(0, T - 2W) (a backward takes about twice a forward). A value
outside every unit has nothing to hide behind. The MILP adds a binary o_i <= s_i per offloadable
value and two exposure variables per unit; the device bytes are sum(nbytes[S]) - sum(nbytes[O]).
Among plans of equal cost, fewer device bytes and then fewer host copies win, so a budget with
room to spare offloads nothing. A unit's front has many more points with offload (every split of
its saved bytes between device and host); it is walked in steps of 1/OFFLOAD_FRONT_STEPS of the
unit's bytes, each point the exact optimum for its budget, and auto takes that plan through the
parts over a MILP on the whole graph (thousands of values times three choices, which a node limit
would cut short anyway).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from passes.sizes import format_size


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Forward values in topological order; see Note [The recompute problem]."""

    names: tuple[str, ...]
    nbytes: tuple[int, ...]
    cost: tuple[float, ...]
    inputs: tuple[tuple[int, ...], ...]
    needed: tuple[bool, ...]
    saveable: tuple[bool, ...] = ()
    """Empty means all values are saveable."""
    recomputable: tuple[bool, ...] = ()
    """Empty means all values are recomputable."""
    offloadable: tuple[bool, ...] = ()
    """Values that may be kept in host memory instead (Note [Offload in the recompute problem]);
    empty means none."""
    transfer: tuple[float, ...] = ()
    """Seconds to copy each value to host memory (as many to copy it back); empty means none."""
    group: tuple[int, ...] = ()
    """The unit each value belongs to (-1: none); empty means none."""

    def __post_init__(self) -> None:
        n = len(self.names)
        for name in ("nbytes", "cost", "inputs", "needed"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Problem.{name} has {len(getattr(self, name))} entries for {n} values")
        if not self.saveable:
            object.__setattr__(self, "saveable", (True,) * n)
        if not self.recomputable:
            object.__setattr__(self, "recomputable", (True,) * n)
        if not self.offloadable:
            object.__setattr__(self, "offloadable", (False,) * n)
        if not self.transfer:
            object.__setattr__(self, "transfer", (0.0,) * n)
        if not self.group:
            object.__setattr__(self, "group", (-1,) * n)
        for name in ("saveable", "recomputable", "offloadable", "transfer", "group"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Problem.{name} has {len(getattr(self, name))} entries for {n} values")
        for i, ins in enumerate(self.inputs):
            if any(not 0 <= j < i for j in ins):
                raise ValueError(f"Problem: value {self.names[i]!r} has inputs {ins}; inputs must come before it")

    def __len__(self) -> int:
        return len(self.names)

    def is_chain(self) -> bool:
        return all(set(ins) <= {i - 1} for i, ins in enumerate(self.inputs))

    def offloads(self) -> bool:
        """Whether any value may be offloaded."""
        return any(self.offloadable)

    def windows(self) -> dict[int, float]:
        """Each unit's compute time (seconds): what hides its copies (Note [Offload in the recompute problem])."""
        out: dict[int, float] = {}
        for g, c in zip(self.group, self.cost):
            if g >= 0:
                out[g] = out.get(g, 0.0) + c
        return out


@dataclass(frozen=True, kw_only=True)
class Solution:
    """A plan for a Problem: saved and recomputed value indices, with their bytes and cost."""

    saved: frozenset[int]
    """Values at hand for the backward: on the device, or in host memory when offloaded."""
    recomputed: frozenset[int]
    saved_bytes: int
    """Bytes the saved values keep on the device (offloaded ones excluded)."""
    cost: float
    """Recompute cost, and the time of the copies compute does not hide."""
    solver: str
    optimal: bool
    """True when the solver proved the plan optimal for the budget."""
    seconds: float = field(default=0.0, compare=False)
    offloaded: frozenset[int] = frozenset()
    """Saved values kept in host memory between the forward and the backward."""


class Infeasible(ValueError):
    """No plan fits the budget; `smallest` is the smallest budget (bytes) any plan fits, and
    `reached`, when known, the smallest as a fraction of the budget's scale (a memory budget's
    fraction of the activation memory without checkpointing)."""

    def __init__(self, budget: int, smallest: int, message: str | None = None, *, reached: float | None = None):
        self.budget, self.smallest, self.reached = budget, smallest, reached
        super().__init__(
            message
            or f"memory budget {_fmt(budget)} is infeasible: the smallest plan saves {_fmt(smallest)} "
            "(values that must not be recomputed, and what recomputation needs)"
        )


Solver = Callable[[Problem, int], Solution]


def _fmt(n: int) -> str:
    return f"{format_size(n)} ({n} bytes)"


def check(problem: Problem, saved: set[int] | frozenset[int], recomputed: set[int] | frozenset[int],
          offloaded: set[int] | frozenset[int] = frozenset()) -> None:
    """Raise AssertionError when a plan breaks a constraint of Note [The recompute problem]
    (the budget aside)."""
    for i in offloaded:
        assert i in saved and problem.offloadable[i], f"{problem.names[i]} offloaded but not saved or not offloadable"
    for i in range(len(problem)):
        name = problem.names[i]
        assert not (i in saved and not problem.saveable[i]), f"{name} saved but not saveable"
        assert not (i in recomputed and not problem.recomputable[i]), f"{name} recomputed but not recomputable"
        if problem.needed[i]:
            assert i in saved or i in recomputed, f"{name} needed but neither saved nor recomputed"
        if i in recomputed:
            for j in problem.inputs[i]:
                assert j in saved or j in recomputed, f"{name} recomputed but its input {problem.names[j]} is not at hand"


def _solution(problem: Problem, saved: set[int], recomputed: set[int], *, solver: str, optimal: bool, start: float,
              offloaded: set[int] | frozenset[int] = frozenset()) -> Solution:
    return Solution(
        saved=frozenset(saved),
        recomputed=frozenset(recomputed),
        saved_bytes=sum(problem.nbytes[i] for i in saved if i not in offloaded),
        cost=sum(problem.cost[i] for i in recomputed) + exposure(problem, offloaded),
        solver=solver,
        optimal=optimal,
        seconds=time.perf_counter() - start,
        offloaded=frozenset(offloaded),
    )


def exposure(problem: Problem, offloaded: set[int] | frozenset[int]) -> float:
    """Seconds the copies of the offloaded values add to a step, compute hiding what it can
    (Note [Offload in the recompute problem])."""
    if not offloaded:
        return 0.0
    windows = problem.windows()
    transfer: dict[int, float] = {}
    total = 0.0
    for i in offloaded:
        g = problem.group[i]
        if g < 0:
            total += 2 * problem.transfer[i]  # nothing hides it, out or back
        else:
            transfer[g] = transfer.get(g, 0.0) + problem.transfer[i]
    for g, t in transfer.items():
        total += max(0.0, t - windows[g]) + max(0.0, t - 2 * windows[g])
    return total


def closure(problem: Problem, saved: set[int] | frozenset[int]) -> set[int] | None:
    """The values the backward must recompute when `saved` is saved, or None when one of them
    cannot be recomputed."""
    recomputed: set[int] = set()
    stack = [i for i in range(len(problem)) if problem.needed[i] and i not in saved]
    while stack:
        i = stack.pop()
        if i in recomputed:
            continue
        if not problem.recomputable[i]:
            return None
        recomputed.add(i)
        stack.extend(j for j in problem.inputs[i] if j not in saved and j not in recomputed)
    return recomputed


def smallest_budget(problem: Problem) -> int:
    """The fewest bytes any valid plan saves (a MILP minimising bytes; the best it found when its
    node limit cut it short)."""
    return _milp(problem, budget=None, node_limit=NODE_LIMIT).saved_bytes


# --- greedy -------------------------------------------------------------------------------------


def greedy(problem: Problem, budget: int) -> Solution:
    """Start from saving every needed value that can be saved; drop saved values, the cheapest
    extra recompute per freed byte first (lazily re-scored against the current plan), until the
    saved bytes fit."""
    import heapq

    start = time.perf_counter()
    saved = save_all(problem)
    recomputed = closure(problem, saved)
    assert recomputed is not None
    total = sum(problem.nbytes[i] for i in saved)

    def drop(i: int) -> tuple[float, int, set[int], set[int]] | None:
        """(added cost, freed bytes, newly recomputed, newly saved) for no longer saving i."""
        new: set[int] = set()
        extra: set[int] = set()
        stack = [i]
        while stack:
            x = stack.pop()
            if (x in saved and x != i) or x in recomputed or x in new or x in extra:
                continue
            if not problem.recomputable[x]:
                if x == i or not problem.saveable[x]:
                    return None
                extra.add(x)
                continue
            new.add(x)
            stack.extend(problem.inputs[x])
        freed = problem.nbytes[i] - sum(problem.nbytes[x] for x in extra)
        return sum(problem.cost[x] for x in new), freed, new, extra

    def score(added: float, freed: int) -> float:
        return added / freed if freed > 0 else math.inf

    heap = []
    for i in saved:
        if problem.recomputable[i] and problem.nbytes[i] > 0:
            d = drop(i)
            if d is not None and d[1] > 0:
                heap.append((score(d[0], d[1]), i))
    heapq.heapify(heap)
    while total > budget and heap:
        key, i = heapq.heappop(heap)
        if i not in saved:
            continue
        d = drop(i)
        if d is None or d[1] <= 0:
            continue
        fresh = score(d[0], d[1])
        if heap and fresh > heap[0][0] + 1e-12 and fresh != key:
            heapq.heappush(heap, (fresh, i))  # the plan changed since i was scored
            continue
        added, freed, new, extra = d
        saved.discard(i)
        saved |= extra
        recomputed |= new
        total -= freed
    if total > budget:
        # Stuck: no single drop frees bytes any more. The plan that saves least may still fit.
        least = _milp(problem, budget=None, node_limit=NODE_LIMIT)
        if least.saved_bytes > budget:
            raise Infeasible(budget, least.saved_bytes)
        saved = set(least.saved)
    recomputed = closure(problem, saved)
    assert recomputed is not None
    return _solution(problem, saved, recomputed, solver="greedy", optimal=False, start=start)


def save_all(problem: Problem) -> set[int]:
    """Every needed value saved; a needed value that cannot be saved (a view) has its inputs
    saved instead, recursively."""
    saved: set[int] = set()
    stack = [i for i in range(len(problem)) if problem.needed[i]]
    while stack:
        i = stack.pop()
        if problem.saveable[i]:
            saved.add(i)
        else:
            stack.extend(j for j in problem.inputs[i] if j not in saved)
    return saved


# --- chain dynamic programme --------------------------------------------------------------------


def chain_dp(problem: Problem, budget: int) -> Solution:
    """Exact for chains: walk the values in order with state = how the previous value is at hand
    in the backward ("saved", "recomputed", or "absent"), keeping per state the Pareto front of
    (saved bytes, cost) with the choices that reach it."""
    start = time.perf_counter()
    if not problem.is_chain():
        raise ValueError("chain_dp needs a chain: every value's inputs are at most its predecessor")
    # front[state] = list of (bytes, cost, saved tuple, recomputed tuple)
    fronts: dict[str, list[tuple[int, float, tuple[int, ...], tuple[int, ...]]]] = {"absent": [(0, 0.0, (), ())]}
    # A value that is absent may still be needed later by a recomputed successor: handle that by
    # letting "recomputed" of i+1 require i saved or recomputed, decided when i is processed. So a
    # value left absent forbids recomputing its successor.
    for i in range(len(problem)):
        has_input = bool(problem.inputs[i])
        nxt: dict[str, list] = {"absent": [], "saved": [], "recomputed": []}
        for state, front in fronts.items():
            for b, c, s, r in front:
                if not problem.needed[i]:
                    nxt["absent"].append((b, c, s, r))
                if problem.saveable[i] and b + problem.nbytes[i] <= budget:
                    nxt["saved"].append((b + problem.nbytes[i], c, s + (i,), r))
                if problem.recomputable[i] and (not has_input or state != "absent"):
                    nxt["recomputed"].append((b, c + problem.cost[i], s, r + (i,)))
        fronts = {k: _pareto(v) for k, v in nxt.items() if v}
        if not fronts:
            raise Infeasible(budget, smallest_budget(problem))
        # A recomputed value whose successor is absent and not needed was recomputed for nothing;
        # the front keeps it only if it is cheaper somewhere, which it is not: harmless.
    best = min((entry for front in fronts.values() for entry in front), key=lambda e: (e[1], e[0]))
    saved, recomputed = set(best[2]), set(best[3])
    # Drop recomputations nobody needs (possible at the end of a chain).
    needed_rec = closure(problem, saved)
    assert needed_rec is not None and needed_rec <= recomputed
    return _solution(problem, saved, needed_rec, solver="chain_dp", optimal=True, start=start)


def _pareto(entries: list) -> list:
    """Entries not dominated in (bytes, cost), one per distinct point."""
    out = []
    best_cost = math.inf
    for entry in sorted(entries, key=lambda e: (e[0], e[1])):
        if entry[1] < best_cost - 1e-15:
            out.append(entry)
            best_cost = entry[1]
    return out


# --- MILP ---------------------------------------------------------------------------------------


# Note [Plans bounded by counts]
# The same graph and options must give the same plan: two ranks of one DDP job, or two runs of one
# script, must not differ because one machine was busier. So the solvers' work is bounded by
# counts, not seconds: a MILP by HiGHS's branch-and-bound nodes (NODE_LIMIT; the GPT-2 and LLaMA
# problems of the tests and benches are proven optimal within 13), a Pareto front by the exact
# solves it makes (FRONT_SOLVES). A time limit remains only as a safety net far above what any
# tested problem needs (SAFETY_SECONDS); a MILP that reaches it logs that its plan depended on the
# clock.
NODE_LIMIT = 10_000
FRONT_SOLVES = 400
SAFETY_SECONDS = 300.0

# Note [A plan within its budget]
# HiGHS accepts a row within its feasibility tolerance, relative to the row's size: a budget row
# of some 3e7 bytes let a plan 1 byte over it through (transformers' Llama block, 30433288 bytes
# saved under a budget of 30433287). A front walked from such a plan asked for the same budget
# again, hundreds of times, until its count of solves ran out (Note [Plans bounded by counts]):
# the front was then not exact, and every budget's candidate was one MILP over the whole graph
# (5.7 s of solving at 24 blocks). So a plan over its budget is solved again with the budget row
# lowered by the excess, at most BUDGET_RETRIES times: milp returns plans within their budget.
BUDGET_RETRIES = 3


def milp(problem: Problem, budget: int, *, node_limit: int = NODE_LIMIT) -> Solution:
    """Exact for any graph (scipy's HiGHS); optimal=False when `node_limit` branch-and-bound nodes
    cut it short (Note [Plans bounded by counts])."""
    return _milp(problem, budget=budget, node_limit=node_limit)


# Note [HiGHS's own prints]
# HiGHS (scipy's MILP solver) writes some lines from C++ straight to the process's standard output
# whatever its options say (e.g. "HighsMipSolverData::transformNewIntegerFeasibleSolution
# tmpSolver.run();"), into the middle of a report a user may pipe to a file. While it solves, file
# descriptor 1 points at the null device; where stdout has no descriptor (an embedding host),
# nothing is redirected.
@contextlib.contextmanager
def _solver_print_dropped() -> Iterator[None]:
    """Standard output's descriptor sent to the null device (Note [HiGHS's own prints])."""
    try:
        sys.stdout.flush()
        kept = os.dup(1)
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(kept, 1)
        os.close(kept)


def _milp(problem: Problem, *, budget: int | None, node_limit: int) -> Solution:
    """budget=None minimises the device bytes instead of cost (the smallest feasible budget)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.optimize import milp as scipy_milp
    from scipy.sparse import vstack

    start = time.perf_counter()
    n = len(problem)
    if n == 0:
        return _solution(problem, set(), set(), solver="milp", optimal=True, start=start)
    model = _milp_model(problem)
    nbytes, cost = model.nbytes, model.cost
    scale_b = max(nbytes.max(), 1.0)
    scale_c = max(cost.max(), model.transfer.max(), 1e-30)
    zeros, o = np.zeros(n), model.offload  # o: the offload variables, when the problem has them
    exposure = np.ones(model.units) / scale_c
    device = np.concatenate([nbytes, zeros, -nbytes if o else [], np.zeros(model.units)])  # saved minus offloaded
    if budget is None:
        objective = device / scale_b + 1e-6 * np.concatenate([zeros, cost / scale_c, zeros if o else [], exposure])
        a, lower, upper = model.a, model.lower, model.upper
    else:
        # Cost first (recomputes and copies not hidden); device bytes break ties, then host copies
        # (a budget with room to spare offloads nothing), weighted below the smallest cost
        # difference that matters and scaled so that a tie-break step stays above HiGHS's absolute
        # gap tolerance (1e-6).
        copies = np.concatenate([zeros, zeros, 2 * nbytes if o else [], np.zeros(model.units)])
        objective = 1e4 * (1e-3 * (device + copies) / scale_b / n
                           + np.concatenate([zeros, cost / scale_c, zeros if o else [], exposure]))
        a = vstack([model.a, device[None, :]], format="csr")
        lower = np.append(model.lower, -np.inf)
        upper = np.append(model.upper, budget)
    width = len(model.ub)
    for _ in range(BUDGET_RETRIES + 1):
        with _solver_print_dropped():
            result = scipy_milp(
                objective,
                constraints=LinearConstraint(a, lower, upper),
                integrality=np.concatenate([np.ones(width - model.units), np.zeros(model.units)]),
                bounds=Bounds(np.zeros(width), model.ub),
                options={"node_limit": node_limit, "time_limit": SAFETY_SECONDS, "mip_rel_gap": 1e-9},
            )
        if budget is None or result.x is None:
            break
        # Note [A plan within its budget]
        over = float(device @ np.round(result.x)) - budget
        if over <= 0:
            break
        upper = upper.copy()
        upper[-1] -= over + 1
    else:
        raise Infeasible(budget, smallest_budget(problem))
    if time.perf_counter() - start >= SAFETY_SECONDS:
        logging.getLogger("ckpt_fx").warning(
            "ckpt_fx: a MILP of %d values reached its %.0f s safety limit: this plan depends on the machine's "
            "speed (solver='greedy' plans by counts alone)", n, SAFETY_SECONDS)
    if result.x is None:
        if budget is not None and result.status == 2:  # infeasible
            raise Infeasible(budget, smallest_budget(problem))
        if budget is None:
            raise ValueError(f"milp: no plan at all for this problem ({result.message})")
        return greedy(problem, budget)  # the limit hit before any plan: fall back
    x = np.round(result.x[: width - model.units]).astype(int)
    saved = {i for i in range(n) if x[i]}
    offloaded = {i for i in range(n) if o and x[2 * n + i]}
    recomputed = closure(problem, saved)
    assert recomputed is not None, "milp returned a plan that recomputes a value that cannot be"
    return _solution(problem, saved, recomputed, solver="milp", optimal=result.status == 0, start=start,
                     offloaded=offloaded)


@dataclass(frozen=True)
class _Model:
    """A Problem's MILP constraints without the budget row (the same for every budget)."""

    a: object
    lower: object
    upper: object
    ub: object
    nbytes: object
    cost: object
    transfer: object
    offload: bool
    """The variables include o_0..o_{n-1} (offloaded) after s and r."""
    units: int
    """Continuous exposure variables at the end: two per unit with offloadable values."""


@functools.lru_cache(maxsize=16)
def _milp_model(problem: Problem) -> _Model:
    """Variables s_0..s_{n-1} (saved), r_0..r_{n-1} (recomputed), and when values may be offloaded
    o_0..o_{n-1} (offloaded) and per unit the seconds its copies add out and back; rows: a needed
    value is saved or recomputed (s_i + r_i >= 1), a recomputed value's inputs are at hand
    (s_j + r_j - r_i >= 0), an offloaded value is saved (o_i <= s_i), a unit's copies beyond its
    compute add time (sum t_i o_i - e <= W, and 2W back) (Note [Offload in the recompute problem])."""
    import numpy as np
    from scipy.sparse import csr_matrix

    n = len(problem)
    offload = problem.offloads()
    windows = problem.windows() if offload else {}
    groups = sorted({problem.group[i] for i in range(n) if problem.offloadable[i]}) if offload else []
    rows, cols, vals, lower, upper = [], [], [], [], []

    def row(entries: list[tuple[int, float]], low: float, high: float = np.inf) -> None:
        k = len(lower)
        for col, val in entries:
            rows.append(k)
            cols.append(col)
            vals.append(val)
        lower.append(low)
        upper.append(high)

    for i in range(n):
        if problem.needed[i]:
            row([(i, 1.0), (n + i, 1.0)], 1.0)
        for j in problem.inputs[i]:
            row([(j, 1.0), (n + j, 1.0), (n + i, -1.0)], 0.0)
    if offload:
        for i in range(n):
            if problem.offloadable[i]:
                row([(2 * n + i, 1.0), (i, -1.0)], -np.inf, 0.0)
        for k, g in enumerate(groups):
            members = [(2 * n + i, problem.transfer[i]) for i in range(n) if problem.offloadable[i] and problem.group[i] == g]
            hidden = windows.get(g, 0.0)
            for way, window in enumerate((hidden, 2 * hidden)):  # out beside a forward, back beside a backward
                row(members + [(3 * n + 2 * k + way, -1.0)], -np.inf, window)
    width = (3 * n if offload else 2 * n) + 2 * len(groups)
    m = max(len(lower), 1)
    a = csr_matrix((vals, (rows, cols)), shape=(m, width))
    lower_arr, upper_arr = np.full(m, -np.inf), np.full(m, np.inf)
    lower_arr[: len(lower)] = lower
    upper_arr[: len(upper)] = upper
    ub = np.ones(width)
    ub[width - 2 * len(groups):] = np.inf
    for i in range(n):
        if not problem.saveable[i]:
            ub[i] = 0
        if not problem.recomputable[i]:
            ub[n + i] = 0
        if offload and not problem.offloadable[i]:
            ub[2 * n + i] = 0
    return _Model(
        a=a, lower=lower_arr, upper=upper_arr, ub=ub,
        nbytes=np.array(problem.nbytes, dtype=float), cost=np.array(problem.cost, dtype=float),
        transfer=np.array(problem.transfer, dtype=float), offload=offload, units=2 * len(groups),
    )


# --- independent parts -------------------------------------------------------------------------

# Note [Independent parts]
# A value that is needed and cannot be recomputed is always saved, so a recompute that reads it
# never reaches past it; and a value that cannot be recomputed never reads its inputs in the
# backward. Cut there, a model's problem falls into independent parts: one per block when block
# outputs are kept (Note [Block boundaries under a budget]), most of them alike. Each part's
# Pareto front of (saved bytes, least cost) is found exactly (the chain DP or the MILP at
# decreasing budgets), once per distinct part; the fronts of all parts are summed (every
# combination, pruned to the undominated ones, which is exact) into the whole problem's front.
# Values recomputed for free from graph inputs alone (views of parameters) tie no parts together.
# One front answers every budget: a 32-block model's candidates take one front, not one MILP each.


def parts(problem: Problem) -> list[list[int]]:
    """The independent parts of a problem (Note [Independent parts]), each a sorted index list."""
    n = len(problem)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    free = _free(problem)
    for i in range(n):
        if not problem.recomputable[i]:
            continue
        for j in problem.inputs[i]:
            if free[j] or (not problem.recomputable[j] and problem.needed[j] and problem.saveable[j]):
                continue
            parent[find(i)] = find(j)
    if problem.offloads():  # a unit's copies share its compute: its values are one part
        first: dict[int, int] = {}
        for i in range(n):
            g = problem.group[i]
            if g >= 0:
                parent[find(i)] = find(first.setdefault(g, i))
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _free(problem: Problem) -> list[bool]:
    """Values recomputed at no cost from nothing but what is always at hand: graph inputs, values
    that must be saved (needed, not recomputable), and other such values (a view of a parameter;
    an attention mask expanded from a saved one and read by every block): reading one ties no
    parts together."""
    free = [False] * len(problem)
    for i in range(len(problem)):
        free[i] = problem.recomputable[i] and problem.cost[i] == 0 and all(
            free[j] or (not problem.recomputable[j] and problem.needed[j] and problem.saveable[j])
            for j in problem.inputs[i])
    return free


def _sub(problem: Problem, members: list[int]) -> Problem:
    """The problem restricted to one part; inputs outside it are always at hand (saved). Units are
    renumbered from 0 in the part, so alike parts are alike."""
    local = {g: k for k, g in enumerate(members)}
    units: dict[int, int] = {}
    return Problem(
        names=tuple(problem.names[g] for g in members),
        nbytes=tuple(problem.nbytes[g] for g in members),
        cost=tuple(problem.cost[g] for g in members),
        inputs=tuple(tuple(local[j] for j in problem.inputs[g] if j in local) for g in members),
        needed=tuple(problem.needed[g] for g in members),
        saveable=tuple(problem.saveable[g] for g in members),
        recomputable=tuple(problem.recomputable[g] for g in members),
        offloadable=tuple(problem.offloadable[g] for g in members),
        transfer=tuple(problem.transfer[g] for g in members),
        group=tuple(-1 if problem.group[g] < 0 else units.setdefault(problem.group[g], len(units)) for g in members),
    )


def _shape(problem: Problem) -> tuple:
    """What a part's front depends on (not its names): alike parts share one front."""
    return (problem.nbytes, problem.cost, problem.inputs, problem.needed, problem.saveable, problem.recomputable,
            problem.offloadable, problem.transfer, problem.group)


@dataclass(frozen=True, kw_only=True)
class Front:
    """The Pareto front of a problem: points (saved bytes, least cost), bytes decreasing; `plan(k)`
    gives point k's (saved, recomputed). `exact` is False when a MILP was cut short or a part had
    too many points."""

    nbytes: tuple[int, ...]
    cost: tuple[float, ...]
    plan: Callable[[int], tuple[frozenset[int], frozenset[int], frozenset[int]]] = field(repr=False)
    """Point k's (saved, recomputed, offloaded)."""
    exact: bool = True

    def solution(self, problem: Problem, budget: int, *, start: float | None = None) -> Solution:
        """The cheapest point that fits `budget`; Infeasible names the smallest."""
        start = time.perf_counter() if start is None else start
        fits = [k for k, b in enumerate(self.nbytes) if b <= budget]
        if not fits:
            raise Infeasible(budget, self.nbytes[-1])
        k = min(fits, key=lambda k: (self.cost[k], self.nbytes[k]))
        saved, recomputed, offloaded = self.plan(k)
        return _solution(problem, set(saved), set(recomputed), solver="parts", optimal=self.exact, start=start,
                         offloaded=offloaded)


FRONT_MAX_POINTS = 256  # per part; a part with more keeps the first ones found (most bytes first)
OFFLOAD_FRONT_STEPS = 48  # with offload, a part's front is walked in steps of its bytes over this
FRONT_STEPS = 512  # without, in steps of its bytes over this (Note [A front's steps])


def _contract(problem: Problem) -> tuple[Problem, list[int]]:
    """The problem without its free links: a value that cannot be saved and costs nothing (a view)
    is always recomputed from its inputs, so its readers read those inputs instead, and its being
    needed means they are. Same optimum, fewer variables. Returns the problem and, for each of its
    values, the index of the value it stands for."""
    n = len(problem)
    free = [not problem.saveable[i] and problem.recomputable[i] and problem.cost[i] == 0 for i in range(n)]
    if not any(free):
        return problem, list(range(n))
    keep = [i for i in range(n) if not free[i]]
    local = {g: k for k, g in enumerate(keep)}
    through: list[tuple[int, ...]] = [()] * n  # for a free value: the kept values it reads
    needed = [problem.needed[i] for i in range(n)]
    for i in range(n):
        if free[i]:
            through[i] = tuple(sorted({x for j in problem.inputs[i] for x in (through[j] if free[j] else (j,))}))
    for i in reversed(range(n)):
        if free[i] and needed[i]:
            for j in problem.inputs[i]:
                needed[j] = True
    inputs = []
    for i in keep:
        ins = {x for j in problem.inputs[i] for x in (through[j] if free[j] else (j,))}
        inputs.append(tuple(sorted(local[x] for x in ins)))
    small = Problem(
        names=tuple(problem.names[i] for i in keep), nbytes=tuple(problem.nbytes[i] for i in keep),
        cost=tuple(problem.cost[i] for i in keep), inputs=tuple(inputs), needed=tuple(needed[i] for i in keep),
        saveable=tuple(problem.saveable[i] for i in keep), recomputable=tuple(problem.recomputable[i] for i in keep),
        offloadable=tuple(problem.offloadable[i] for i in keep), transfer=tuple(problem.transfer[i] for i in keep),
        group=tuple(problem.group[i] for i in keep),
    )
    return small, keep


# Note [A front's steps]
# A part's front is walked from each plan to the cheapest one saving at least a step less (1/512
# of the part's bytes; 1 byte in a part of a few hundred): each point is the exact optimum at its
# budget, and a budget between two points gets the one below it, which costs more than the
# skipped plans by at most the difference of the two points' costs. Walked byte by byte, a
# transformers' Llama block (76 values, eager costs) had 223 points, most of them triples 4 bytes
# apart (a scalar saved or not: the same plan in all that counts), found in 4.2 s; summed over 24
# blocks, the whole front took 77 s to build. In steps it has 39 points, found in 0.6 s.


def _part_front(problem: Problem, node_limit: int, solves: list[int]) -> Front:
    """A part's front, walking down from the plan that recomputes least: the cheapest plan under
    budget b, then under (its saved bytes - a step), until none fits (on the contracted problem):
    steps of 1/FRONT_STEPS of the part's bytes (Note [A front's steps]); with
    offload, of 1/OFFLOAD_FRONT_STEPS (Note [Offload in the recompute
    problem]: each point exact for its budget, points between skipped). `solves` is the count of
    exact solves left to all parts (each part makes at least one)."""
    whole, (problem, keep) = problem, _contract(problem)
    stride = max(1, sum(problem.nbytes) // (OFFLOAD_FRONT_STEPS if problem.offloads() else FRONT_STEPS))
    exact_solver = chain_dp if problem.is_chain() and not problem.offloads() else (
        lambda p, b: milp(p, b, node_limit=node_limit))
    nbytes, cost, plans, exact = [], [], [], True
    budget = sum(problem.nbytes)
    while len(nbytes) < FRONT_MAX_POINTS and (not nbytes or solves[0] > 0):
        solves[0] -= 1
        try:
            sol = exact_solver(problem, budget)
        except Infeasible:
            break
        exact = exact and sol.optimal
        if nbytes and sol.cost <= cost[-1] + 1e-12 * max(abs(cost[-1]), 1e-30):
            # As cheap with fewer bytes: the last point was not the least bytes for its cost.
            nbytes.pop(), cost.pop(), plans.pop()
        nbytes.append(sol.saved_bytes)
        cost.append(sol.cost)
        saved = frozenset(keep[i] for i in sol.saved)
        plans.append((saved, frozenset(closure(whole, saved)), frozenset(keep[i] for i in sol.offloaded)))
        if sol.saved_bytes == 0:
            break
        budget = sol.saved_bytes - stride
    else:
        exact = False
    if not nbytes:
        raise Infeasible(0, smallest_budget(problem))
    return Front(nbytes=tuple(nbytes), cost=tuple(cost), plan=plans.__getitem__, exact=exact)


def pareto_front(problem: Problem, *, node_limit: int = NODE_LIMIT, max_solves: float = math.inf) -> Front:
    """The whole problem's front from its parts' fronts (Note [Independent parts]); walking the
    parts' fronts stops after `max_solves` exact solves in all (the front is then not exact; Note
    [Plans bounded by counts])."""
    import numpy as np

    solves = [max_solves]
    members = parts(problem)
    cache: dict[tuple, Front] = {}
    fronts = []
    for m in members:
        sub = _sub(problem, m)
        key = _shape(sub)
        if key not in cache:
            cache[key] = _part_front(sub, node_limit, solves)
        fronts.append(cache[key])
    # Sum the fronts one part at a time, keeping for each point which point of each part made it.
    total_b = np.zeros(1, dtype=np.int64)
    total_c = np.zeros(1)
    picks = np.zeros((1, 0), dtype=np.int32)
    for front in fronts:
        b = (total_b[:, None] + np.array(front.nbytes, dtype=np.int64)[None, :]).ravel()
        c = (total_c[:, None] + np.array(front.cost)[None, :]).ravel()
        left, right = np.divmod(np.arange(b.size), len(front.nbytes))
        order = np.lexsort((b, c))  # cost ascending, then bytes
        b, c, left, right = b[order], c[order], left[order], right[order]
        keep = b < np.concatenate(([np.iinfo(np.int64).max], np.minimum.accumulate(b)[:-1]))
        total_b, total_c = b[keep], c[keep]
        picks = np.concatenate([picks[left[keep]], right[keep, None].astype(np.int32)], axis=1)
    order = np.argsort(-total_b, kind="stable")
    picks = picks[order]

    def plan(k: int) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
        saved, offloaded = set(), set()
        for m, front, p in zip(members, fronts, picks[k]):
            part_saved, _, part_offloaded = front.plan(int(p))
            saved.update(m[i] for i in part_saved)
            offloaded.update(m[i] for i in part_offloaded)
        recomputed = closure(problem, saved)  # with the free values the parts read
        assert recomputed is not None
        return frozenset(saved), frozenset(recomputed), frozenset(offloaded)

    return Front(
        nbytes=tuple(int(x) for x in total_b[order]),
        cost=tuple(float(x) for x in total_c[order]),
        plan=plan,
        exact=all(f.exact for f in fronts),
    )


PART_MAX_VALUES = 300  # a larger part has too many front points to walk one MILP at a time


def parts_pay_off(problem: Problem) -> bool:
    """Whether solving through parts beats solving the whole: the parts are small and mostly
    alike, so their distinct ones hold a small share of the values (a stack of blocks)."""
    members = parts(problem)
    if len(members) < 2 or max(len(m) for m in members) > PART_MAX_VALUES:
        return False
    distinct: dict[tuple, int] = {}
    for m in members:
        distinct.setdefault(_shape(_sub(problem, m)), len(m))
    return 4 * sum(distinct.values()) <= len(problem)


def by_parts(problem: Problem, budget: int, *, node_limit: int = NODE_LIMIT, max_solves: float = math.inf) -> Solution:
    """Exact through the problem's independent parts (Note [Independent parts]); optimal=False when
    a part's front could not be proven exact (or was cut short after `max_solves` solves)."""
    start = time.perf_counter()
    return pareto_front(problem, node_limit=node_limit, max_solves=max_solves).solution(problem, budget, start=start)


SOLVERS: dict[str, Solver] = {"chain_dp": chain_dp, "milp": milp, "greedy": greedy, "parts": by_parts}


def solve(
    problem: Problem, budget: int, *, solver: str = "auto", node_limit: int = NODE_LIMIT, try_parts: bool = True
) -> Solution:
    """The best available plan: chain_dp for chains (without offload), else through independent parts when that
    pays off (parts_pay_off, `try_parts`) and their fronts are found exactly within FRONT_SOLVES
    solves, else the MILP within `node_limit` nodes (up to `MILP_MAX_VALUES` values), else greedy;
    the better of MILP and greedy when the MILP was cut short. Bounded by counts alone (Note
    [Plans bounded by counts])."""
    if solver == "chain_dp":
        return chain_dp(problem, budget)
    if solver == "greedy":
        return greedy(problem, budget)
    if solver == "milp":
        return milp(problem, budget, node_limit=node_limit)
    if solver == "parts":
        return by_parts(problem, budget, node_limit=node_limit)
    if solver != "auto":
        raise ValueError(f"unknown solver {solver!r}; valid: auto, {', '.join(SOLVERS)}")
    if problem.is_chain() and not problem.offloads():
        return chain_dp(problem, budget)
    if try_parts and parts_pay_off(problem):
        split = by_parts(problem, budget, node_limit=node_limit, max_solves=FRONT_SOLVES)
        if split.optimal or problem.offloads():  # Note [Offload in the recompute problem]
            return split
    fast = greedy(problem, budget)
    if len(problem) > MILP_MAX_VALUES:
        return fast
    exact = milp(problem, budget, node_limit=node_limit)
    return exact if exact.optimal or exact.cost <= fast.cost else fast


MILP_MAX_VALUES = 4000
