"""DistributedDataParallel with backend="ckpt": two real processes on loopback (gloo, CPU)."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import ckpt_fx
        from tests._models import Spec, inputs, make

        spec = Spec(depth=4, width=32)
        model = make(spec)
        x = inputs(spec, 4, 32, seed=rank)
        out = {"rank": rank}
        for name in ("plain", "ckpt"):
            m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
            b = ckpt_fx.backend(policy="blocks:every=1,skip_first=0", strict=True) if name == "ckpt" else ckpt_fx.backend(policy="none")
            fn = torch.compile(m, backend=b)
            fn(x).sin().sum().backward()  # compiles; DDP all-reduces the gradients
            out[f"{name}_grads"] = [p.grad.clone() for p in m.parameters()]
            for p in m.parameters():
                p.grad = None
            out[f"{name}_peak"] = ckpt_fx.peak_bytes(lambda: fn(x).sin().sum().backward())
            out[f"{name}_plans"] = [(p.recomputed, [s.name for s in p.saved]) for p in b.plans]
            torch._dynamo.reset()
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))  # tensors do not outlive a queue's sender
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_exact_gradients_same_plans_lower_peak(tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_ddp_worker, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    # Single-process eager on the whole batch: DDP averages the ranks' gradients.
    from tests._models import Spec, inputs, make

    spec = Spec(depth=4, width=32)
    model = make(spec)
    for rank in range(WORLD):
        model(inputs(spec, 4, 32, seed=rank)).sin().sum().div(WORLD).backward()
    for r in results:
        for ckpt, plain, eager in zip(r["ckpt_grads"], r["plain_grads"], model.parameters()):
            assert torch.equal(ckpt, plain)
            assert torch.allclose(ckpt, eager.grad, rtol=1e-4, atol=1e-6)
        assert r["ckpt_peak"] < 0.8 * r["plain_peak"], (r["ckpt_peak"], r["plain_peak"])
    assert results[0]["ckpt_plans"] == results[1]["ckpt_plans"]  # every rank reaches the same plan
    assert results[0]["ckpt_plans"][0][0], "nothing was recomputed"


def test_ddp_example_under_torchrun_plans_every_graph_piece():
    """examples/ddp.py with torchrun, 2 processes: trains, and every graph DDP's optimizer split
    off still finds its blocks (no fallback to top-level children)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
         "examples/ddp.py"],
        capture_output=True, text=True, timeout=300, cwd=root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2: loss" in done.stdout and "(rank 0 of 2)" in done.stdout
    assert "no stack of repeated blocks" not in done.stderr
