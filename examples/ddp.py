"""DistributedDataParallel with backend="ckpt". Launch with torchrun, unchanged on CPU and GPUs:

    torchrun --nproc-per-node 2 examples/ddp.py        # gloo on CPU, nccl when CUDA is there

Run with plain `python examples/ddp.py` it forms a group of one process.
"""

import os
import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ckpt_fx
from ckpt_fx.bench.models import build

if "RANK" not in os.environ:  # plain python: a group of one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")

torch.manual_seed(0)  # the same initial weights on every rank
model = DDP(build("llama", layers=6, dim=128, heads=4).to(device), device_ids=[device.index] if cuda else None)
backend = ckpt_fx.backend(policy="blocks")
compiled = torch.compile(model, backend=backend)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

torch.manual_seed(100 + rank)  # each rank its own data
ids = torch.randint(0, 1000, (4, 128), device=device)
for step in range(3):
    loss = compiled(ids, ids)
    loss.backward()  # DDP all-reduces the gradients while the backward recomputes the blocks
    opt.step()
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.5f} (rank 0 of {world})")
if rank == 0:
    plan = backend.plans[0]
    print(f"plan: {plan.policy}, {len(plan.recomputed)} ops recomputed, saved {plan.saved_bytes / 2**20:.1f} MB per rank")
dist.destroy_process_group()
