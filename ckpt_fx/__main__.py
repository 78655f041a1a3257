"""python -m ckpt_fx {demo,explain,bench,solvers,fit}: the demo trains a built-in model with and without
checkpointing; fit plans a training step's memory for a model too large for this machine."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time


class _Parser(argparse.ArgumentParser):
    """One clear line on a bad argument; every option's help shows its default. --help imports no
    torch, so it answers at once."""

    def error(self, message: str) -> None:  # one clear line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")

    def add_argument(self, *args, **kwargs):
        default = kwargs.get("default")
        if args and str(args[0]).startswith("--") and default not in (None, False):
            kwargs["help"] = f"{kwargs.get('help') or ''} (default: {default})".strip()
        return super().add_argument(*args, **kwargs)


def _count(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fractions(text: str) -> tuple[float, ...]:
    """argparse type: ','-separated numbers in (0, 1], e.g. 0.9,0.7,0.5."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ','-separated numbers like 0.7,0.5,0.3, got {text!r}") from None
    bad = [v for v in values if not 0 < v <= 1]
    if bad:
        raise argparse.ArgumentTypeError(f"every value must be in (0, 1], got {bad[0]:g}")
    return values


def _progress(label: str) -> None:
    print(f"  ... {label}", file=sys.stderr, flush=True)


def demo(args: argparse.Namespace) -> int:
    import torch

    import ckpt_fx
    from ckpt_fx.bench.models import build

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    torch.manual_seed(0)
    model = build(args.model, layers=args.layers, dim=args.dim, heads=args.heads).to(args.device).train()
    ids = torch.randint(0, model.head.out_features, (args.batch, args.seq), device=args.device)
    ckpt = ckpt_fx.backend(policy=args.policy)
    compiler = ckpt.options.compiler  # the time to compare with: the same inner compiler, no checkpointing
    plain = "inductor" if compiler == "inductor" else "aot_eager"
    setups = (("eager (no checkpointing)", None), (f"torch.compile {plain} (no checkpointing)", plain),
              (f"backend='ckpt' policy={args.policy} ({compiler})", ckpt))
    # Each setup compiles and is measured once on its own; the timed steps then take turns, one
    # setup after another in each round, so a drift in the machine's speed falls on all of them.
    runs = []
    for name, backend in setups:
        _progress(name)
        m = copy.deepcopy(model)
        fn = m if backend is None else torch.compile(m, backend=backend)
        run = {"setup": name, "fn": fn, "opt": torch.optim.SGD(m.parameters(), lr=1e-2), "losses": [], "times": []}

        def step(run=run) -> None:
            loss = run["fn"](ids, ids)
            loss.backward()
            run["losses"].append(loss.item())

        run["step"] = step
        step()  # warm-up (compiles)
        run["opt"].zero_grad(set_to_none=True)
        run["losses"].clear()
        run["peak"] = ckpt_fx.peak_bytes(step, device=args.device)
        run["opt"].step()
        run["opt"].zero_grad(set_to_none=True)
        runs.append(run)
    for _ in range(args.steps):
        for run in runs:
            start = time.perf_counter()
            run["step"]()
            if args.device == "cuda":
                torch.cuda.synchronize()
            run["times"].append(time.perf_counter() - start)
            run["opt"].step()
            run["opt"].zero_grad(set_to_none=True)
    rows = [{"setup": r["setup"], "peak_mb": r["peak"] / 2**20,
             "step_s": statistics.median(r["times"]), "losses": r["losses"]}
            for r in runs]
    base, compiled = rows[0], rows[1]
    print(f"\n{args.model} model: {args.layers} blocks, dim {args.dim}, batch {args.batch}x{args.seq}, "
          f"{args.steps} timed steps each, setups taking turns, {args.device}, torch {torch.__version__}\n")
    print(f"| setup | peak MB | x eager | step s | x eager | x {plain} | losses |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        losses = ", ".join(f"{v:.4f}" for v in r["losses"])
        print(f"| {r['setup']} | {r['peak_mb']:.1f} | {r['peak_mb'] / base['peak_mb']:.2f} | {r['step_s']:.3f} | "
              f"{r['step_s'] / base['step_s']:.2f} | {r['step_s'] / compiled['step_s']:.2f} | {losses} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def bench(args: argparse.Namespace) -> int:
    import torch

    from ckpt_fx.bench import plot
    from ckpt_fx.bench import table as b
    from ckpt_fx.bench import setups as st

    if args.head or args.compiler:
        return _bench_head(args)
    setups = tuple(s.strip() for s in args.setups.split(";")) if args.setups else st.default_setups(args.device)
    try:
        if args.sweep:
            if args.setups:
                raise ValueError("give --setups or --sweep, not both")
            setups = st.sweep_setups(args.sweep)
        st.parse_setups(setups)  # a bad name is refused before the model is built
        if args.plot:
            plot.require_matplotlib()
        workload = _workload(args).to(args.device)
        rows = b.run(workload, setups, steps=args.steps, amp=args.amp, progress=True, fallback_random=args.fallback_random)
    except ValueError as error:
        print(f"python -m ckpt_fx bench: error: {error}", file=sys.stderr)
        return 2
    amp = (", bf16 autocast" if args.amp else "") + (", Inductor's fallback_random" if args.fallback_random else "")
    where = f"{torch.cuda.get_device_name()}, " if args.device == "cuda" else ""
    print(f"\n{workload.name}; {where}torch {torch.__version__}; {args.steps} timed steps (median){amp}\n")
    print(b.markdown(rows))
    marks = b.dominance_markdown(rows)
    if marks:
        print("\nEach peer against our plans (peak <= and step time <=, measured in this run):\n" + marks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(b.as_dicts(rows), f, indent=2, allow_nan=False)
    if args.plot:
        plot.plot(rows, args.plot, title=f"{workload.name}; torch {torch.__version__}{amp}")
        print(f"\nplot: {args.plot}")
    return 0


def _bench_head(args: argparse.Namespace) -> int:
    """bench --head: the loss head's table (ckpt_fx.bench.head) on the workload --model names."""
    from ckpt_fx.bench import head
    from ckpt_fx.dynamo_backend import Options

    try:
        if not args.head:
            raise ValueError("--compiler applies to --head (the --setups name their own inner compilers)")
        given = [flag for flag, value in (("--setups", args.setups), ("--sweep", args.sweep), ("--plot", args.plot),
                                          ("--json", args.json), ("--amp", args.amp),
                                          ("--fallback-random", args.fallback_random)) if value]
        if given:
            raise ValueError(f"--head runs its own setups; drop {', '.join(given)}")
        compiler = args.compiler or Options.settings_from_env().get("compiler", "inductor")
        workload = _workload(args)
        print(head.table(workload, compiler=compiler, rounds=args.steps, device=args.device))
    except ValueError as error:
        print(f"python -m ckpt_fx bench: error: {error}", file=sys.stderr)
        return 2
    return 0


def solvers(args: argparse.Namespace) -> int:
    import torch

    from ckpt_fx.bench import solver_table as table

    fractions = args.budgets
    names = tuple(s.strip() for s in args.solvers.split(","))
    workload = _workload(args)
    _progress(f"tracing {workload.name}")
    problem, nodes = table.joint_problem(workload)
    _progress(f"{nodes} joint-graph nodes, {len(problem)} values; solving")
    rows = table.solver_rows(problem, fractions, solvers=names, node_limit=args.node_limit)
    print(f"\n{workload.name}: {nodes} joint-graph nodes, {len(problem)} values; torch {torch.__version__}\n")
    print(table.solver_markdown(rows))
    return 0


def _workload(args: argparse.Namespace):
    from ckpt_fx.bench import workloads

    return workloads.workload(args.model, layers=args.layers, dim=args.dim, heads=args.heads, batch=args.batch,
                              seq=args.seq, overrides=workloads.parse_overrides(args.config),
                              default_layers=args.default_layers)


def explain(args: argparse.Namespace) -> int:
    import ckpt_fx

    workload = _workload(args)
    _progress(f"planning {workload.name} with policy {args.policy}")
    report = ckpt_fx.explain(workload.model, *workload.args, policy=args.policy, measure=args.measure,
                             compiler=args.compiler, **workload.kwargs)
    print(report.format(top=args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": report.policy, "compiler": report.compiler, "predicted_peak_bytes": report.predicted_peak_bytes,
                       "measured_peak_bytes": report.measured_peak_bytes, "eager_peak_bytes": report.eager_peak_bytes,
                       "no_checkpoint_peak_bytes": report.no_checkpoint_peak_bytes,
                       "blocks": [vars(b) for p in report.plans for b in p.blocks], "warnings": list(report.warnings)},
                      f, indent=2)
    return 0


def fit(args: argparse.Namespace) -> int:
    import torch

    import ckpt_fx.fit as f

    memory = [f.parse_memory(m) for m in args.memory.split(",")]
    policies = [p.strip() for p in args.policies.split(";") if p.strip()]
    f.parse_policies(policies)  # a misspelt policy or LoRA option is told before the model is built
    lora = f.parse_lora(args.lora) if args.lora else None
    _progress("building the model on the meta device (nothing allocated)")
    with torch.device("meta"):
        workload = _workload(args)
        model = workload.model
        if lora is not None:
            model = f.with_lora(model, **lora)
    start = time.perf_counter()
    _progress(f"planning {workload.name}: {len(policies)} policies, traced together")
    report = f.fit(model, *workload.args, memory=memory, policies=policies, optimizer=args.optimizer,
                   precision=args.precision, device=args.device, dtype=args.dtype, progress=True,
                   seq_dim=1 if args.max_seq else None, gpus=args.gpus, shard=args.shard, grad_accum=args.grad_accum,
                   every_block=args.every_block, **workload.kwargs)
    rows = []
    for limit in memory:
        report = report.for_memory(limit)
        print(report)
        print()
        rows += [{"memory_bytes": limit, **row} for row in report.to_json()]
    seconds = time.perf_counter() - start
    print(f"planned in {seconds:.0f} s")
    if report.planned_whole_for and seconds > 30:
        _progress(f"every block was traced and planned for {', '.join(report.planned_whole_for)} (each depends on "
                  "the whole stack); --policies 'none;blocks;selective;offload' plans a stack of alike blocks from a few of them, faster")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


def _model_options(p: argparse.ArgumentParser, *, model: str, layers: int) -> None:
    p.add_argument("--model", default=model,
                   help="a config.json: its path, a directory holding one, or a hub name (transformers' "
                        "AutoConfig; causal, seq2seq or masked LM); gpt2 (transformers' GPT2LMHeadModel), llama or "
                        "gpt (built-in); hf:<ConfigClass> (any transformers causal-LM config, e.g. hf:LlamaConfig); "
                        "or module:function (a factory returning (model, args) or (model, args, kwargs))")
    p.add_argument("--config", help="config overrides, e.g. 'num_key_value_heads=2,rope_theta=1e4' "
                                    "(config files, built-in and hf: models)")
    p.add_argument("--layers", type=_count, help=f"blocks (default: a config file's own, else {layers})")
    p.add_argument("--dim", type=_count, help="width (default: a config file's own, else 256)")
    p.add_argument("--heads", type=_count, help="attention heads (default: a config file's own, else 4)")
    p.add_argument("--batch", type=_count, default=8)
    p.add_argument("--seq", type=_count, default=256)
    p.set_defaults(default_layers=layers)


# Written out, not read from ckpt_fx.policies: --help must not import torch (Note [A package that
# imports torch when used] in ckpt_fx/__init__.py); tests/test_policies.py checks it names every form.
POLICY_HELP = ('"blocks", "blocks:N", "blocks:every=N,skip_first=K", "offload", "segments:N", "sqrt", "selective", '
               '"budget:0.3", "budget:2GiB", "none", "graph" (README, Policies)')
FIT_POLICIES = "none;blocks;selective;sqrt;offload;budget:fit;budget:fit,offload"
"""fit's default policies (ckpt_fx.fit.DEFAULT_POLICIES, written out for the same reason)."""


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m ckpt_fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    d = sub.add_parser("demo", help="train a built-in model with and without checkpointing")
    d.add_argument("--model", choices=("llama", "gpt"), default="llama")
    d.add_argument("--layers", type=_count, default=8)
    d.add_argument("--dim", type=_count, default=256)
    d.add_argument("--heads", type=_count, default=4)
    d.add_argument("--batch", type=_count, default=8)
    d.add_argument("--seq", type=_count, default=256)
    d.add_argument("--steps", type=_count, default=3, help="timed steps per setup, the setups taking turns "
                   "(the median is shown), after one step measured for the peak")
    d.add_argument("--policy", default="blocks", help=POLICY_HELP)
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    d.add_argument("--json", help="also write the results to this file")
    d.set_defaults(run=demo)
    e = sub.add_parser("explain", help="what a policy saves and recomputes, block by block")
    _model_options(e, model="gpt2", layers=12)
    e.add_argument("--policy", default="blocks", help=POLICY_HELP)
    e.add_argument("--measure", action="store_true", help="also measure the peak, with and without checkpointing")
    e.add_argument("--compiler", choices=("inductor", "eager"), default=None,
                   help="inner compiler to plan for (default: CKPT_FX_COMPILER, else inductor)")
    e.add_argument("--top", type=_count, help="list only the N largest saved tensors")
    e.add_argument("--json", help="also write the report to this file")
    e.set_defaults(run=explain)
    bn = sub.add_parser("bench", help="peak memory and step time of every setup, side by side")
    _model_options(bn, model="gpt2", layers=12)
    bn.add_argument("--steps", type=_count, default=3, help="timed steps per setup (the median is shown)")
    bn.add_argument("--setups", help="';'-separated, e.g. 'eager;checkpoint;ckpt:blocks'; forms: eager, checkpoint "
                    "(HF per-block), sac, inductor-sac, aot_eager, inductor, inductor-budget:<x>, ckpt:<policy>, "
                    "ckpt-eager:<policy>, ckpt-inductor:<policy> (default on cpu, under the default inner compiler as "
                    "enable uses it: eager;checkpoint;inductor-budget:0.5;ckpt:blocks;ckpt:blocks:every=1,skip_first=0;"
                    "ckpt:selective;ckpt:budget:0.5 (Inductor compiles cost a minute or two per setup on a CPU); "
                    "with CKPT_FX_COMPILER=eager: eager;checkpoint;aot_eager-budget:0.5;ckpt-eager:blocks;"
                    "ckpt-eager:blocks:every=1,skip_first=0;ckpt-eager:selective;ckpt-eager:budget:0.5; on cuda "
                    "the Inductor ones with inductor, inductor-sac and ckpt:none)")
    bn.add_argument("--sweep", type=_fractions, help="','-separated budgets, e.g. 0.9,0.7,0.5,0.3,0.15: torch's knob and ckpt:budget at "
                    "each, beside Inductor alone, ckpt:none, torch's op-level selective checkpointing, ckpt:selective, "
                    "HF per-block checkpointing beside ours on every block (instead of --setups)")
    bn.add_argument("--amp", action="store_true", help="run every step under bf16 autocast")
    bn.add_argument("--fallback-random", action="store_true",
                    help="Inductor draws random numbers as eager does, so the gradient column compares its setups "
                         "with dropout too (torch._inductor.config.fallback_random)")
    bn.add_argument("--head", action="store_true",
                    help="the loss head instead: HF's checkpointing, ckpt-fx with the head whole and in chunks, and "
                         "HF's checkpointing with torchtune's chunked cross-entropy and cut-cross-entropy's head where "
                         "installed, on a transformers causal LM (--model: a config file, gpt2, hf:<ConfigClass>); "
                         "--steps interleaved rounds")
    bn.add_argument("--compiler", choices=("inductor", "eager"),
                    help="with --head: ckpt-fx's inner compiler (default: CKPT_FX_COMPILER, else inductor)")
    bn.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bn.add_argument("--plot", help="also draw peak against step time (Pareto front) into this PNG (matplotlib)")
    bn.add_argument("--json", help="also write the rows to this file")
    bn.set_defaults(run=bench)
    sv = sub.add_parser("solvers", help="the budget solvers side by side on a model's recompute problem")
    _model_options(sv, model="gpt2", layers=12)
    sv.add_argument("--budgets", type=_fractions, default="0.7,0.5,0.3,0.15",
                    help="','-separated fractions of the no-recompute saved bytes")
    sv.add_argument("--solvers", default="milp,greedy,parts,auto")
    sv.add_argument("--node-limit", type=_count, default=100_000, help="branch-and-bound nodes per MILP")
    sv.set_defaults(run=solvers)
    ft = sub.add_parser("fit", help="will a training step fit? its peak per policy, planned without the hardware")
    _model_options(ft, model="llama", layers=8)
    ft.add_argument("--memory", default="24GiB", help="device memory, e.g. 24GiB, 80GB; ','-separated for several")
    ft.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="fp32",
                    help="fp32, or bf16-mixed (fp32 weights, gradients and optimizer state; bf16 autocast)")
    ft.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "none"), default="adamw")
    ft.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="where the step would run (how the optimizer holds its temporaries)")
    ft.add_argument("--lora", help="train peft LoRA adapters on a frozen base: r=N[,alpha=M][,dropout=P]"
                    "[,target_modules=all-linear|NAME|[NAME,...]] (peft's names; default targets: peft's for the "
                    "model), e.g. 'r=16,alpha=32,dropout=0.05,target_modules=all-linear'")
    ft.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "nf4"), default=None,
                    help="the weights' dtype: the frozen base (under --lora) and buffers are cast to it, trained "
                         "parameters keep theirs (fp32 master weights and adapters); nf4: the base's linear layers "
                         "in 4 bits as bitsandbytes holds them for QLoRA (double quantisation), the rest in bf16; "
                         "default: as built (fp32)")
    ft.add_argument("--policies", default=FIT_POLICIES,
                    help="';'-separated policies to plan; budget:fit is a memory budget of what --memory leaves "
                         "after weights and optimizer state, budget:fit,offload one that may keep saved values in "
                         "host memory")
    ft.add_argument("--gpus", type=_count, default=1,
                    help="GPUs the step runs on; --batch is then each rank's; the table is one rank's")
    ft.add_argument("--shard", choices=("fsdp", "none"), default=None,
                    help="with --gpus: fsdp (FSDP2 full shard, fully_shard per block and at the root; the default) "
                         "or none (a replica per GPU, as DDP); hybrid sharding holds per rank what fsdp over its "
                         "shard group does: plan it with --gpus GROUP")
    ft.add_argument("--grad-accum", type=_count, default=1,
                    help="micro-batches of --batch accumulated per optimizer step (their gradients held between)")
    ft.add_argument("--max-seq", action="store_true",
                    help="also the longest sequence that fits at --batch, per policy (the sequence traced as dynamic; "
                         "--seq must differ from --batch)")
    ft.add_argument("--every-block", action="store_true",
                    help="trace and plan every block, where the policies (none, blocks, offload, selective) would "
                         "otherwise be planned on the model cut to a few of its alike blocks and extrapolated")
    ft.add_argument("--json", help="also write one row per memory size and policy to this file")
    ft.set_defaults(run=fit)
    args = parser.parse_args(argv)
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
