"""FSDP2 (fully_shard) with backend="ckpt". Launch with torchrun, unchanged on CPU and GPUs:

    torchrun --nproc-per-node 2 examples/fsdp2.py        # gloo on CPU, nccl when CUDA is there

fully_shard on every block and on the root, as FSDP2 is usually applied. dynamo then compiles each
block as a graph of its own, so the policy is "graph": each block's graph saves its input and
recomputes the rest in the backward. Do not also wrap the blocks in FSDP's or torch's
checkpoint_wrapper: that would checkpoint twice. Run with plain `python examples/fsdp2.py` it forms
a group of one process.
"""

import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import ckpt_fx
from ckpt_fx.bench.models import build

if "RANK" not in os.environ:  # plain python: a group of one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")

torch.manual_seed(0)  # the same initial weights on every rank
model = build("llama", layers=6, dim=128, heads=4).to(device)
for block in model.layers:
    fully_shard(block)  # each block's parameters are gathered just before it runs
fully_shard(model)
backend = ckpt_fx.backend(policy="graph")
compiled = torch.compile(model, backend=backend)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

torch.manual_seed(100 + rank)  # each rank its own data
ids = torch.randint(0, 1000, (4, 128), device=device)
for step in range(3):
    loss = compiled(ids, ids)
    loss.backward()  # FSDP reduce-scatters the gradients while the backward recomputes each block
    opt.step()
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.5f} (rank 0 of {world})")
if rank == 0:
    block_plan = max(backend.plans, key=lambda p: len(p.recomputed))
    print(f"block graph: {len(block_plan.recomputed)} ops recomputed, saves {block_plan.saved_bytes / 2**20:.2f} MB per block")
dist.destroy_process_group()
