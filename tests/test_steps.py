"""planning's runtime: garbage collection thresholds and the fresh stack it runs on."""

from __future__ import annotations

import pytest




def test_planning_holds_full_collections_and_gives_the_thresholds_back():
    """Note [Collections while planning]: inside, the oldest generation waits; after, even after an
    error, the collector's thresholds are the process's own; with the collector off, nothing changes."""
    import gc

    from passes.steps import FULL_COLLECTIONS_HELD, without_full_collections

    before = gc.get_threshold()
    with pytest.raises(ValueError, match="planning failed"), without_full_collections():
        assert gc.get_threshold() == (*before[:2], FULL_COLLECTIONS_HELD)
        raise ValueError("planning failed")
    assert gc.get_threshold() == before
    gc.disable()
    try:
        with without_full_collections():
            assert gc.get_threshold() == before
    finally:
        gc.enable()


def _page_faults(fn) -> int:
    """The minor page faults the process takes while fn() runs."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_loop_on_a_fresh_stack_chunk_crosses_no_chunk_edge():
    """Note [Compiling on a fresh stack chunk]: called from some depth, a loop's calls cross an
    edge of the interpreter's frame stack, each call mapping a chunk and faulting on it; run
    through on_a_fresh_stack, the same loop takes almost no page faults from any depth. Its result
    and its errors come through unchanged."""
    pytest.importorskip("resource")
    from passes.steps import on_a_fresh_stack

    calls = 5_000

    def leaf(i: int) -> int:
        return i & 1

    def loop() -> int:
        return sum(leaf(i) for i in range(calls))

    def at(depth: int, fn):
        return fn() if depth == 0 else at(depth - 1, fn)

    depths = range(400)  # the edges of three chunks or more
    plain = [_page_faults(lambda: at(d, loop)) for d in depths]
    if max(plain) < calls // 2:
        pytest.skip("no depth here at which each call maps a chunk (CPython 3.13+ caches one; before 3.11 no chunks)")
    fresh = [_page_faults(lambda: at(d, lambda: on_a_fresh_stack(loop))) for d in depths]
    assert max(fresh) < calls // 50, [(d, f) for d, f in zip(depths, fresh) if f >= calls // 50][:5]
    assert at(plain.index(max(plain)), lambda: on_a_fresh_stack(loop)) == calls // 2
    with pytest.raises(ValueError, match="compile failed"):
        on_a_fresh_stack(lambda: (_ for _ in ()).throw(ValueError("compile failed")))
