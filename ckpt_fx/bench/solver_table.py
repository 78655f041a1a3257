"""The budget solvers side by side on a model's recompute problem (`python -m ckpt_fx solvers`):
each one's recompute cost, its gap to the MILP's proven optimum, its time."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from ckpt_fx.dynamo_backend import backend as ckpt_backend
from ckpt_fx.bench.workloads import Workload


@dataclass(frozen=True, kw_only=True)
class SolverRow:
    """One solver at one budget on a model's recompute problem."""

    solver: str
    fraction: float
    cost_us: float | None
    """Recompute cost of its plan (microseconds on the roofline); None when it found none."""
    gap: float | None
    """cost / the proven optimum - 1 (0 when optimal; None without a proven optimum)."""
    seconds: float
    optimal: bool
    error: str | None = None


def joint_problem(workload: Workload):
    """The recompute problem (passes.solve.Problem) of the workload's first joint graph, as the
    budget policy builds it, and the number of nodes of that graph."""
    from passes.budget import build_problem
    from passes.select import hard_rules

    b = ckpt_backend(policy="none", compiler="eager")
    joints = []
    b.on_partitioned.append(lambda done: joints.append(done.joint))
    model = copy.deepcopy(workload.model)
    workload.loss(torch.compile(model, backend=b)).backward()
    torch.compiler.reset()
    joint = max(joints, key=lambda j: len(j.graph.nodes))
    return build_problem(joint, hard_rules=hard_rules(joint)).problem, len(joint.graph.nodes)


def solver_rows(problem, fractions: tuple[float, ...] = (0.7, 0.5, 0.3, 0.15), *,
                solvers: tuple[str, ...] = ("milp", "greedy", "parts", "auto"), node_limit: int = 100_000) -> list[SolverRow]:
    """Every solver at every budget (a fraction of the no-recompute saved bytes) on one problem;
    the gap is measured against the MILP's proven optimum."""
    from passes.budget import baseline_bytes
    from passes.solve import Infeasible, by_parts, greedy, milp, solve

    run = {
        "milp": lambda p, b: milp(p, b, node_limit=node_limit),
        "greedy": greedy,
        "parts": lambda p, b: by_parts(p, b, node_limit=node_limit),
        "auto": solve,
    }
    unknown = sorted(set(solvers) - set(run))
    if unknown:
        raise ValueError(f"unknown solver(s) {unknown}; valid: {', '.join(run)}")
    base = baseline_bytes(problem)
    rows = []
    for f in fractions:
        budget = int(f * base)
        results = {}
        for name in solvers:
            start = time.perf_counter()
            try:
                results[name] = (run[name](problem, budget), None)
            except Infeasible as error:
                results[name] = (None, str(error))
            results[name] += (time.perf_counter() - start,)
        best = results.get("milp", (None,))[0]
        optimum = best.cost if best is not None and best.optimal else None
        for name, (sol, error, seconds) in results.items():
            gap = None if sol is None or optimum is None else (sol.cost / optimum - 1 if optimum > 0 else float(sol.cost > 0))
            rows.append(SolverRow(solver=name, fraction=f, cost_us=None if sol is None else sol.cost * 1e6, gap=gap,
                                  seconds=seconds, optimal=bool(sol and sol.optimal), error=error))
    return rows


def solver_markdown(rows: list[SolverRow]) -> str:
    out = ["| budget | solver | recompute cost (us) | gap to optimum | proven optimal | seconds |",
           "|---:|---|---:|---:|---|---:|"]
    for r in rows:
        if r.error is not None:
            out.append(f"| {r.fraction} | {r.solver} | infeasible | | | {r.seconds:.2f} |")
            continue
        gap = f"{max(100 * r.gap, 0.0):.2f}%" if r.gap is not None else "-"  # no "-0.00%" from rounding
        out.append(f"| {r.fraction} | {r.solver} | {r.cost_us:.1f} | {gap} | {'yes' if r.optimal else 'no'} | {r.seconds:.2f} |")
    return "\n".join(out)
