"""The budget solvers on plain data: one table of cases for every solver, and properties on random
chains (the DP and the MILP agree) and random graphs (every plan is valid, greedy never beats the
MILP optimum)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from passes.solve import Infeasible, Problem, by_parts, chain_dp, check, greedy, milp, parts, solve


def chain(nbytes, cost, needed, *, saveable=(), recomputable=()) -> Problem:
    n = len(nbytes)
    return Problem(
        names=tuple(f"v{i}" for i in range(n)), nbytes=tuple(nbytes), cost=tuple(float(c) for c in cost),
        inputs=tuple(() if i == 0 else (i - 1,) for i in range(n)), needed=tuple(needed),
        saveable=tuple(saveable), recomputable=tuple(recomputable),
    )


DIAMOND = Problem(  # a -> b, a -> c, (b, c) -> d; the backward reads b, c and d
    names=("a", "b", "c", "d"), nbytes=(8, 8, 8, 8), cost=(5.0, 1.0, 1.0, 1.0),
    inputs=((), (0,), (0,), (1, 2)), needed=(False, True, True, True),
)

# (id, problem, budget, expected least cost, or an int: the smallest feasible budget when infeasible)
CASES = [
    ("all fit", chain([4, 4, 4, 4], [1, 2, 3, 4], [True] * 4), 16, 0.0),
    ("keep the costly ones", chain([4, 4, 4, 4], [1, 2, 3, 4], [True] * 4), 8, 3.0),
    ("keep nothing", chain([4, 4, 4, 4], [1, 2, 3, 4], [True] * 4), 0, 10.0),
    ("a bigger value is cheaper to drop", chain([2, 8, 2], [3, 3, 3], [True] * 3), 4, 3.0),
    # v1 is not read by the backward, but recomputing v2 needs it.
    ("unneeded link", chain([10, 10, 10], [5, 1, 1], [True, False, True]), 10, 2.0),
    # v0 must not run twice: it is saved, and v1 is recomputed from it.
    ("not recomputable", chain([10, 1], [1, 1], [True, True], recomputable=(False, True)), 10, 1.0),
    ("infeasible", chain([10, 1], [1, 1], [True, True], recomputable=(False, True)), 5, 10),
    # v1 is a view of v0 (cannot be saved itself): keeping it means keeping v0.
    ("view", chain([8, 0, 4], [3, 0, 1], [False, True, True], saveable=(True, False, True)), 8, 1.0),
    ("view, nothing kept", chain([8, 0, 4], [3, 0, 1], [False, True, True], saveable=(True, False, True)), 0, 4.0),
    ("diamond, all fit", DIAMOND, 24, 0.0),
    ("diamond, save a", DIAMOND, 8, 3.0),  # recompute b, c, d from a: 3 < 5 + ...
    ("diamond, save b and c", DIAMOND, 16, 1.0),
    ("diamond, nothing", DIAMOND, 0, 8.0),
]

SOLVERS = {"chain_dp": chain_dp, "milp": milp, "greedy": greedy, "parts": by_parts, "auto": solve}


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_table(case, solver):
    _, problem, budget, expected = case
    fn = SOLVERS[solver]
    if solver == "chain_dp" and not problem.is_chain():
        with pytest.raises(ValueError, match="chain"):
            fn(problem, budget)
        return
    if isinstance(expected, int):
        with pytest.raises(Infeasible) as error:
            fn(problem, budget)
        assert error.value.smallest == expected
        assert f"({expected} bytes)" in str(error.value)
        return
    sol = fn(problem, budget)
    check(problem, sol.saved, sol.recomputed)
    assert sol.saved_bytes <= budget
    if solver == "greedy":
        assert sol.cost >= expected - 1e-9  # a heuristic: never better than the optimum
    else:
        assert sol.cost == pytest.approx(expected)
        assert sol.optimal


def test_bad_problems_are_refused():
    with pytest.raises(ValueError, match="inputs must come before"):
        Problem(names=("a",), nbytes=(1,), cost=(1.0,), inputs=((0,),), needed=(True,))
    with pytest.raises(ValueError, match="cost has 0 entries for 1"):
        Problem(names=("a",), nbytes=(1,), cost=(), inputs=((),), needed=(True,))
    with pytest.raises(ValueError, match="unknown solver 'fast'"):
        solve(DIAMOND, 8, solver="fast")


@st.composite
def chains(draw):
    n = draw(st.integers(1, 9))
    nbytes = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    cost = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    needed = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    recomputable = draw(st.lists(st.booleans(), min_size=n, max_size=n).map(lambda r: [x or i % 3 for i, x in enumerate(r)]))
    budget = draw(st.integers(0, sum(nbytes)))
    return chain(nbytes, cost, needed, recomputable=[bool(r) for r in recomputable]), budget


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 12))
    inputs = tuple(tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=2)))) if i else () for i in range(n))
    nbytes = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    cost = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    needed = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    budget = draw(st.integers(0, sum(nbytes)))
    problem = Problem(names=tuple(map(str, range(n))), nbytes=tuple(nbytes), cost=tuple(map(float, cost)),
                      inputs=inputs, needed=tuple(needed))
    return problem, budget


def _outcome(fn, problem, budget):
    try:
        sol = fn(problem, budget)
    except Infeasible as error:
        return ("infeasible", error.smallest)
    check(problem, sol.saved, sol.recomputed)
    assert sol.saved_bytes <= budget
    return ("ok", sol.cost)


@given(chains())
def test_chain_dp_and_milp_agree_on_chains(case):
    problem, budget = case
    dp, exact = _outcome(chain_dp, problem, budget), _outcome(milp, problem, budget)
    assert dp[0] == exact[0]
    assert dp[1] == pytest.approx(exact[1])


@given(graphs())
def test_greedy_is_valid_and_never_beats_the_milp(case):
    problem, budget = case
    fast, exact = _outcome(greedy, problem, budget), _outcome(milp, problem, budget)
    assert fast[0] == exact[0]  # greedy finds a plan whenever one exists
    if exact[0] == "ok":
        assert fast[1] >= exact[1] - 1e-9
    else:
        assert fast == exact


@st.composite
def split_graphs(draw):
    """Random graphs some of whose values are needed and never recomputed (block outputs): they
    fall into independent parts, sometimes alike."""
    problem, budget = draw(graphs())
    n = len(problem)
    cuts = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    copies = draw(st.integers(1, 3))
    # Repeat the graph `copies` times, each copy reading the previous copy's last value.
    names, nbytes, cost, inputs, needed, recomputable = [], [], [], [], [], []
    for c in range(copies):
        for i in range(n):
            names.append(f"{c}.{i}")
            nbytes.append(problem.nbytes[i])
            cost.append(problem.cost[i])
            ins = tuple(c * n + j for j in problem.inputs[i]) or (((c * n - 1),) if c else ())
            inputs.append(ins)
            needed.append(problem.needed[i] or cuts[i])
            recomputable.append(not cuts[i])
    big = Problem(names=tuple(names), nbytes=tuple(nbytes), cost=tuple(cost), inputs=tuple(inputs),
                  needed=tuple(needed), recomputable=tuple(recomputable))
    return big, draw(st.integers(0, sum(nbytes)))


@given(split_graphs())
def test_parts_agree_with_the_milp(case):
    problem, budget = case
    split, exact = _outcome(by_parts, problem, budget), _outcome(milp, problem, budget)
    assert split[0] == exact[0]
    assert split[1] == pytest.approx(exact[1])


def _alike_blocks(count: int = 32) -> Problem:
    block = [(16, 1.0, False), (64, 0.5, True), (64, 2.0, True), (16, 0.1, True)]
    names, nbytes, cost, inputs, needed, recomputable = [], [], [], [], [], []
    for b in range(count):
        for k, (nb, c, need) in enumerate(block):
            i = len(names)
            names.append(f"b{b}.{k}")
            nbytes.append(nb)
            cost.append(c)
            inputs.append((i - 1,) if i else ())
            last = k == len(block) - 1
            needed.append(need or last)
            recomputable.append(not last)
            if k == 2:
                inputs[-1] = (i - 2, i - 1)  # not a chain
    return Problem(names=tuple(names), nbytes=tuple(nbytes), cost=tuple(cost), inputs=tuple(inputs),
                   needed=tuple(needed), recomputable=tuple(recomputable))


def test_alike_blocks_are_solved_once():
    """A chain of 32 alike blocks, outputs kept: 32 parts (plus the kept outputs), one front each
    shape; the plan equals the MILP's."""
    problem = _alike_blocks()
    nbytes = problem.nbytes
    assert len(parts(problem)) == 64
    budget = sum(nbytes) // 3
    split, exact = by_parts(problem, budget), milp(problem, budget)
    assert split.optimal and split.solver == "parts"
    assert split.cost == pytest.approx(exact.cost)
    check(problem, split.saved, split.recomputed)
    assert split.saved_bytes <= budget


def test_a_front_cut_short_is_marked_inexact():
    """pareto_front under a count of solves it cannot meet: still a valid front (each point a
    valid plan), marked not exact, so auto does not trust it."""
    from passes.solve import pareto_front

    problem = DIAMOND  # one part, four front points: with one solve allowed, only the first is found
    front = pareto_front(problem, max_solves=1)
    assert not front.exact and len(front.nbytes) == 1
    for k in range(len(front.nbytes)):
        saved, recomputed, offloaded = front.plan(k)
        check(problem, saved, recomputed, offloaded)


def test_a_slow_clock_gives_the_same_plan(monkeypatch):
    """Note [Plans bounded by counts]: no decision of our solvers reads the clock. A clock that
    runs 1000 s per reading (a loaded machine, as our code sees it) gives the same plan, by the
    same solver, as the real one. This covers our code (the choice between the parts, the MILP
    and greedy, the front's walk); HiGHS itself is bounded by node_limit (branch-and-bound nodes),
    its time limit only a safety net (SAFETY_SECONDS) far above what these problems take."""
    import passes.solve as solve_module

    problem = _alike_blocks(8)
    budget = sum(problem.nbytes) // 3
    real = solve(problem, budget)
    ticks = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(solve_module.time, "perf_counter", lambda: float(next(ticks)))
    slow = solve(problem, budget)
    assert (slow.solver, slow.saved, slow.recomputed) == (real.solver, real.saved, real.recomputed)


def _offload_blocks(count: int, *, transfer: float, offloadable: bool = True) -> Problem:
    """`count` alike blocks (unit b), each a chain: an input copy (not recomputable, 16 bytes, its
    block's boundary), two values the backward reads (64 bytes, cost 1 each). Each block's
    compute (its window) is 2.5 seconds; `transfer` is each value's copy time, one way."""
    names, nbytes, cost, inputs, needed, recomputable, can, group = [], [], [], [], [], [], [], []
    for b in range(count):
        for k, (nb, c, rec) in enumerate([(16, 0.5, False), (64, 1.0, True), (64, 1.0, True)]):
            i = len(names)
            names.append(f"b{b}.{k}")
            nbytes.append(nb)
            cost.append(c)
            inputs.append((i - 1,) if k else ())
            needed.append(True)
            recomputable.append(rec)
            can.append(offloadable)
            group.append(b)
    n = len(names)
    return Problem(names=tuple(names), nbytes=tuple(nbytes), cost=tuple(cost), inputs=tuple(inputs),
                   needed=tuple(needed), recomputable=tuple(recomputable), offloadable=tuple(can),
                   transfer=(transfer,) * n, group=tuple(group))


def test_free_copies_offload_what_the_budget_needs_and_nothing_more():
    """Note [Offload in the recompute problem]: copies compute hides cost nothing. With room to
    spare nothing is offloaded; at a device budget of 0 every value is offloaded (nothing
    recomputed, no time added); where the budget needs bytes off the device, offloading beats
    recomputing."""
    problem = _offload_blocks(2, transfer=0.0)
    roomy = milp(problem, sum(problem.nbytes))
    assert roomy.offloaded == frozenset() and roomy.cost == 0
    empty = milp(problem, 0)
    check(problem, empty.saved, empty.recomputed, empty.offloaded)
    assert empty.offloaded == frozenset(range(len(problem))) and not empty.recomputed
    assert empty.saved_bytes == 0 and empty.cost == 0
    half = milp(problem, sum(problem.nbytes) // 2)
    assert half.saved_bytes <= sum(problem.nbytes) // 2 and half.offloaded and not half.recomputed


def test_slow_copies_are_priced_and_recompute_wins_where_it_is_cheaper():
    """Copies slower than compute cost what compute does not hide: at 10 s a copy (2.5 s of
    compute per block), recomputing the two 64-byte values of a block (2 s) beats offloading
    them; the 16-byte inputs, which cannot be recomputed, are offloaded at a device budget of 0,
    their time added (out 10 - 2.5, back 10 - 5 per block)."""
    problem = _offload_blocks(2, transfer=10.0)
    sol = milp(problem, 0)
    check(problem, sol.saved, sol.recomputed, sol.offloaded)
    boundaries = {0, 3}
    assert sol.offloaded == boundaries and sol.recomputed == {1, 2, 4, 5}
    assert sol.cost == pytest.approx(4 * 1.0 + 2 * ((10 - 2.5) + (10 - 5)))
    with pytest.raises(Infeasible):
        milp(_offload_blocks(2, transfer=10.0, offloadable=False), 0)


@pytest.mark.parametrize("transfer", [0.0, 0.7, 3.0])
def test_alike_blocks_with_offload_solve_through_parts_as_the_whole(transfer):
    """With offload, a unit's values are one part (its copies share its compute): the parts'
    front gives the MILP's cost on the whole at every budget, and a valid plan."""
    problem = _offload_blocks(4, transfer=transfer)
    assert len(parts(problem)) == 4
    for budget in (0, 100, 300, sum(problem.nbytes)):
        whole, split = milp(problem, budget), by_parts(problem, budget)
        check(problem, split.saved, split.recomputed, split.offloaded)
        assert split.saved_bytes <= budget
        assert split.cost == pytest.approx(whole.cost)


def test_a_milp_plan_keeps_within_its_budget_where_the_solvers_tolerance_would_let_it_over():
    """Note [A plan within its budget]: on this problem (megabyte values, costs of microseconds)
    HiGHS returns a plan 1 byte over a budget of 4202499 bytes, within its feasibility tolerance;
    milp solves again below it. A part's front walked from such a plan asked for the same budget
    until its solves ran out."""
    problem = Problem(
        names=tuple(map(str, range(12))),
        nbytes=(1048576, 4096, 4096, 2097152, 4096, 2097152, 2097152, 2097152, 2097152, 4, 1048576, 3145728),
        cost=(1.4e-06, 5e-05, 1.4e-06, 0.0002, 0.0001, 0.0013, 0.0001, 0.0013, 0.0002, 0.0001, 1.4e-06, 5e-05),
        inputs=((), (0,), (), (1, 2), (), (), (), (5,), (1, 4), (4,), (), (3, 9)),
        needed=(True, False, True, True, True, False, True, False, True, False, True, True),
    )
    budget = 4202499
    plan = milp(problem, budget)
    assert plan.saved_bytes <= budget
    check(problem, plan.saved, plan.recomputed)
    from passes.solve import pareto_front
    front = pareto_front(problem)
    assert front.exact and all(b <= a for a, b in zip(front.nbytes, front.nbytes[1:]))


def test_what_the_solver_prints_to_the_process_stdout_is_dropped(capfd):
    """HiGHS prints some lines from C++ to file descriptor 1 (Note [HiGHS's own prints]); they
    must not land in a report on stdout, and stdout works again afterwards."""
    import os

    from passes.solve import _solver_print_dropped

    with _solver_print_dropped():
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
    os.write(1, b"after\n")
    assert capfd.readouterr().out == "after\n"
