"""rewrite_graph: the checkpointing transformation on an FX GraphModule, for plain eager autograd."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ckpt_fx import policies
from ckpt_fx.dynamo_backend import CkptBackend, Options
from passes import Plan
from passes._compat import aot_module_simplified, boxed_nop, propagate_fake_values, pytree, pytree_info
from passes.head import head_pass
from passes.steps import on_a_fresh_stack


class RewrittenGraphModule(torch.fx.GraphModule):
    """A GraphModule whose forward runs the partitioned forward under autograd; its backward
    recomputes what the plan did not save. `code` lists the backward with its recompute marked."""

    plan: Plan | None
    forward_graph: torch.fx.GraphModule | None
    backward_graph: torch.fx.GraphModule | None

    @property
    def code(self) -> str:  # type: ignore[override]
        text = super().code
        bw = self.__dict__.get("backward_graph")
        plan = self.__dict__.get("plan")
        if bw is None or plan is None:
            return text
        recomputed = set(plan.recomputed)
        lines = [
            "",
            f"# ckpt_fx plan: {plan.policy}; saved {plan.saved_bytes} activation bytes; "
            f"{len(recomputed)} forward ops recomputed in backward (marked <- recompute)",
            "# backward:",
        ]
        for line in bw.code.strip("\n").splitlines():
            target = line.strip().split(" = ", 1)[0]
            mark = "  # <- recompute" if target in recomputed else ""
            lines.append(f"#   {line}{mark}")
        return text + "\n".join(lines) + "\n"


def _flat_output_module(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, pytree.TreeSpec, list[Any]]:
    """A GraphModule sharing gm's parameters whose output is the flat tuple of gm's output tensors."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    result = graph.graph_copy(gm.graph, env)
    info = pytree_info(gm)
    if info is not None and info.out_spec is not None:
        # torch.export's modules unflatten their flat outputs in generated code.
        result = pytree.tree_unflatten(list(result), info.out_spec)
    leaves, spec = pytree.tree_flatten(result)
    graph.output(tuple(leaf for leaf in leaves if isinstance(leaf, torch.fx.Node)))
    return torch.fx.GraphModule(gm, graph), spec, leaves


def rewrite_graph(
    gm: torch.fx.GraphModule,
    policy: policies.Policy | str | None = None,
    example_inputs: Sequence[Any] = (),
    *,
    strict: bool = False,
    head: str = "chunked",
) -> RewrittenGraphModule:
    """Return a GraphModule computing what gm computes whose backward recomputes what `policy`
    does not save, under ordinary eager autograd (no torch.compile).

    The result shares parameters and buffers with gm (same objects: an optimizer built on either
    keeps working) and is specialised to the shapes of `example_inputs`: other shapes raise.
    `result.plan` is the Plan; `print(result.code)` shows the backward with its recompute marked.
    `head`: "chunked" rewrites a loss head the graph computes (`F.cross_entropy` over a vocabulary
    projection, Note [The loss head in chunks] in passes/head.py) into chunks of tokens; "whole"
    keeps it as written.
    """
    if not isinstance(gm, torch.fx.GraphModule):
        raise ValueError(f"rewrite_graph takes a torch.fx.GraphModule, got {type(gm).__name__}; "
                         "use torch.fx.symbolic_trace(model) or torch.export.export(model, args).module()")
    # The graphs run eagerly under autograd: planned for the eager inner compiler (AOTAutograd's
    # default partition), not for Inductor's min-cut.
    options = Options(policy=policies.parse(policy), strict=strict, compiler="eager", progress=False, head=head)
    info = pytree_info(gm)
    if info is not None and info.in_spec is not None:
        flat_inputs = pytree.tree_flatten((tuple(example_inputs), {}))[1]
        if info.in_spec != flat_inputs:
            raise ValueError(
                "rewrite_graph supports torch.export modules called with positional tensors only; "
                f"this one expects inputs shaped {info.in_spec}"
            )
    example_inputs = list(example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(example_inputs) != len(placeholders):
        raise ValueError(
            f"rewrite_graph: the graph takes {len(placeholders)} input(s) "
            f"({', '.join(n.name for n in placeholders)}), got {len(example_inputs)} example input(s)"
        )
    flat, spec, leaves = _flat_output_module(gm)
    backend = CkptBackend(options)
    if head == "chunked" and torch.is_grad_enabled() and any(n.target is F.cross_entropy for n in flat.graph.nodes):
        # Note [The loss head in chunks] in passes/head.py; the pass reads traced shapes, which a
        # symbolic_trace graph lacks until its values are propagated.
        propagate_fake_values(flat, example_inputs)
        backend.head_report = head_pass(flat)
    captured: dict[str, torch.fx.GraphModule] = {}

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = backend.partition(joint, joint_inputs, **kwargs)
        captured["forward"], captured["backward"] = fw, bw
        return fw, bw

    # Note [Compiling on a fresh stack chunk] in passes/steps.py
    compiled = on_a_fresh_stack(lambda: aot_module_simplified(
        flat,
        example_inputs,
        fw_compiler=boxed_nop,
        bw_compiler=boxed_nop,
        partition_fn=partition,
        keep_inference_input_mutations=True,
    ))
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in example_inputs]

    def checkpointed(*args: Any) -> Any:
        for i, (arg, shape) in enumerate(zip(args, shapes)):
            if shape is not None and (not isinstance(arg, torch.Tensor) or tuple(arg.shape) != shape):
                got = tuple(arg.shape) if isinstance(arg, torch.Tensor) else type(arg).__name__
                raise ValueError(
                    f"rewrite_graph result is specialised to input {i} of shape {shape}, got {got}; "
                    "call rewrite_graph again with example inputs of the new shape"
                )
        return compiled(*args)

    checkpointed.__module__ = __name__

    graph = torch.fx.Graph()
    inputs = [graph.placeholder(n.target, default_value=n.args[0] if n.args else inspect.Signature.empty) for n in placeholders]
    call = graph.call_function(checkpointed, tuple(inputs))
    node_leaves = iter(range(sum(isinstance(leaf, torch.fx.Node) for leaf in leaves)))
    out_leaves = [graph.call_function(_getitem, (call, next(node_leaves))) if isinstance(leaf, torch.fx.Node) else leaf for leaf in leaves]
    graph.output(pytree.tree_unflatten(out_leaves, spec))

    result = RewrittenGraphModule(torch.nn.Module(), graph, class_name="Rewritten" + type(gm).__name__)
    for name, child in gm.named_children():
        result.add_module(name, child)
    for name, param in gm.named_parameters(recurse=False):
        result.register_parameter(name, param)
    for name, buf in gm.named_buffers(recurse=False):
        result.register_buffer(name, buf)
    # Plain attributes, not submodules: they hold no parameters of their own.
    result.__dict__["plan"] = backend.plans[-1] if backend.plans else None
    result.__dict__["forward_graph"] = captured.get("forward")
    result.__dict__["backward_graph"] = captured.get("backward")
    result.__dict__["_compiled"] = compiled
    return result


def _getitem(values: Sequence[Any], index: int) -> Any:
    return values[index]
