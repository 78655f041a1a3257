"""python -m ckpt_fx {demo,bench}: the demo trains a built-in model with and without checkpointing."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time

import torch


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _progress(label: str) -> None:
    print(f"  ... {label}", file=sys.stderr, flush=True)


def demo(args: argparse.Namespace) -> int:
    import ckpt_fx
    from ckpt_fx.models import build

    torch.manual_seed(0)
    model = build(args.model, layers=args.layers, dim=args.dim, heads=args.heads).train()
    ids = torch.randint(0, model.head.out_features, (args.batch, args.seq))
    rows = []
    for name, policy in (("eager (no checkpointing)", None), (f"backend='ckpt' policy={args.policy}", args.policy)):
        _progress(name)
        m = copy.deepcopy(model)
        fn = m if policy is None else torch.compile(m, backend=ckpt_fx.backend(policy=policy))
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        losses, times, peak = [], [], 0

        def step() -> None:
            loss = fn(ids, ids)
            loss.backward()
            losses.append(loss.item())

        step()  # warm-up (compiles)
        opt.zero_grad(set_to_none=True)
        losses.clear()
        for i in range(args.steps):
            start = time.perf_counter()
            if i == 0:
                peak = ckpt_fx.peak_bytes(step)
            else:
                step()
            times.append(time.perf_counter() - start)
            opt.step()
            opt.zero_grad(set_to_none=True)
        rows.append({"setup": name, "peak_mb": peak / 2**20, "step_s": statistics.median(times), "losses": losses})
    base = rows[0]
    print(f"\n{args.model} model: {args.layers} blocks, dim {args.dim}, batch {args.batch}x{args.seq}, {args.steps} steps, CPU\n")
    print("| setup | peak MB | x eager | step s | x eager | losses |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        losses = ", ".join(f"{v:.4f}" for v in r["losses"])
        print(f"| {r['setup']} | {r['peak_mb']:.1f} | {r['peak_mb'] / base['peak_mb']:.2f} | {r['step_s']:.3f} | "
              f"{r['step_s'] / base['step_s']:.2f} | {losses} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def bench(args: argparse.Namespace) -> int:
    from ckpt_fx import bench as b

    if args.model == "gpt2":
        workload = b.gpt2_workload(layers=args.layers, dim=args.dim, heads=args.heads, batch=args.batch, seq=args.seq)
    else:
        workload = b.builtin_workload(args.model, layers=args.layers, dim=args.dim, heads=args.heads, batch=args.batch, seq=args.seq)
    setups = tuple(s.strip() for s in args.setups.split(";")) if args.setups else b.DEFAULT_SETUPS
    rows = b.run(workload, setups, steps=args.steps, progress=_progress)
    print(f"\n{workload.name}; torch {torch.__version__}; {args.steps} timed steps (median)\n")
    print(b.markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(b.as_dicts(rows), f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m ckpt_fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    d = sub.add_parser("demo", help="train a built-in model with and without checkpointing")
    d.add_argument("--model", choices=("llama", "gpt"), default="llama")
    d.add_argument("--layers", type=int, default=8)
    d.add_argument("--dim", type=int, default=256)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--seq", type=int, default=256)
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--policy", default="blocks")
    d.add_argument("--json", help="also write the results to this file")
    d.set_defaults(run=demo)
    bn = sub.add_parser("bench", help="peak memory and step time of every setup, side by side")
    bn.add_argument("--model", choices=("gpt2", "llama", "gpt"), default="gpt2")
    bn.add_argument("--layers", type=int, default=12)
    bn.add_argument("--dim", type=int, default=256)
    bn.add_argument("--heads", type=int, default=4)
    bn.add_argument("--batch", type=int, default=8)
    bn.add_argument("--seq", type=int, default=256)
    bn.add_argument("--steps", type=int, default=5)
    bn.add_argument("--setups", help="';'-separated, e.g. 'eager;checkpoint;ckpt:blocks' (default: all)")
    bn.add_argument("--json", help="also write the rows to this file")
    bn.set_defaults(run=bench)
    args = parser.parse_args(argv)
    for name in ("layers", "dim", "heads", "batch", "seq", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "policy", None) is not None:
        from ckpt_fx import policies

        try:
            policies.parse(args.policy)
        except ValueError as error:
            parser.error(str(error))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        return args.run(args)
    except (ValueError, ImportError) as error:
        parser.error(str(error))
    return 1


if __name__ == "__main__":
    sys.exit(main())
