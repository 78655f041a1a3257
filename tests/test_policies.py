"""Policies: string forms, validation before tracing, and the decisions they make."""

from __future__ import annotations

import pytest

import ckpt_fx
from ckpt_fx import CheckpointPolicy, policies
from passes.regions import Block
from passes.policy import NodeInfo


def blocks_of(n: int, stack: str = "layers") -> list[Block]:
    return [Block(path=f"{stack}.{i}", stack=stack, index=i, stack_len=n, number=i) for i in range(n)]


def info(block: Block | None, users: tuple, *, region: str | None = None, path: str = "") -> NodeInfo:
    return NodeInfo(
        name="n", op="aten.mm.default", module_path=path or (block.path if block else ""),
        region=region or ("block" if block else "other"), block=block, user_blocks=users,
        shape=(2, 2), dtype=None, nbytes=16, flops=16, is_view=False,
    )


@pytest.mark.parametrize(
    "spec, name",
    [
        (None, "blocks(every=1, skip_first=auto)"),
        ("blocks", "blocks(every=1, skip_first=auto)"),
        ("blocks:4", "blocks(every=4, skip_first=auto)"),
        ("blocks:every=2,skip_first=0", "blocks(every=2, skip_first=0)"),
        ("segments:4", "segments(size=4, skip_first=0)"),
        ("segments:size=3,skip_first=1", "segments(size=3, skip_first=1)"),
        ("sqrt", "sqrt(skip_first=0)"),
        (" None ", "none()"),
        ("graph", "graph()"),
        ("selective", "selective(save=('matmul', 'conv', 'attention'), skip_first=0)"),
        ("selective:skip_first=1", "selective(save=('matmul', 'conv', 'attention'), skip_first=1)"),
        ("selective:save=matmul", "selective(save=('matmul'), skip_first=0)"),
        ("selective:save=matmul+attention,skip_first=2", "selective(save=('matmul', 'attention'), skip_first=2)"),
        ("sqrt:skip_first=1", "sqrt(skip_first=1)"),
        ("offload", "blocks(every=1, skip_first=auto, offload=True)"),
        ("offload:every=2,skip_first=0", "blocks(every=2, skip_first=0, offload=True)"),
    ],
)
def test_string_forms(spec, name):
    """Every documented string parses to the policy of that name."""
    assert policies.policy_name(policies.parse(spec)) == name


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("blokcs", "unknown policy 'blokcs' (did you mean 'blocks'?)"),
        ("segments", "segments needs size; segments is written \"segments:N\""),
        ("segments:0", "size must be >= 1, got 0; segments is written"),
        ("blocks:every=0", "every must be >= 1, got 0; blocks is written"),
        ("blocks:two", "every='two' is not a whole number; blocks is written \"blocks\", \"blocks:N\""),
        ("blocks:stride=2", "blocks has no setting 'stride' (its settings: every, skip_first); blocks is written"),
        ("sqrt:3", "sqrt takes no bare value, got '3'; sqrt is written \"sqrt\", \"sqrt:skip_first=K\""),
        ("selective:save=matmul,size=2", "selective has no setting 'size' (its settings: save, skip_first); selective is written"),
        ("offload:size=2", "offload has no setting 'size'"),
        ("selective:save=matmull", "save item 'matmull' is not an op class (did you mean 'matmul'?)"),
        ("budget:fit,offload", "'fit' is a form fit plans"),
        (42, "must be a string or a callable"),
    ],
)
def test_bad_policies_raise_value_error_naming_the_value(spec, fragment):
    """A bad policy fails at construction with the bad value and the form it expected (every
    valid form for an unknown name)."""
    with pytest.raises(ValueError) as err:
        ckpt_fx.backend(policy=spec)
    assert fragment in str(err.value)
    if isinstance(spec, str) and "unknown" in fragment:
        assert 'policies: blocks, offload, segments, sqrt, none, graph, selective, budget' in str(err.value)


def test_factory_arguments_are_checked():
    """Keyword-only, typed, in range: a bool never lands in a count."""
    with pytest.raises(ValueError, match="every must be an int"):
        policies.blocks(every=True)
    with pytest.raises(ValueError, match="skip_first must be >= 0"):
        policies.blocks(skip_first=-1)
    with pytest.raises(TypeError):
        policies.segments(4)  # keyword-only
    with pytest.raises(ValueError, match="patterns must be non-empty"):
        policies.only_in([], "blocks")


def test_backend_options_are_validated():
    with pytest.raises(ValueError, match="unknown compiler 'tvm'; valid: 'eager', 'inductor'"):
        ckpt_fx.backend(compiler="tvm")
    with pytest.raises(ValueError, match="debug must be False, True or 'values'"):
        ckpt_fx.backend(debug="yes")
    with pytest.raises(ValueError, match="strict must be True or False"):
        ckpt_fx.backend(strict=1)
    with pytest.raises(ValueError, match=r"unknown ckpt option\(s\) \['polcy'\]; valid: policy, compiler, strict"):
        ckpt_fx.Options.from_mapping({"polcy": "blocks"})


def test_blocks_recomputes_insides_and_saves_what_leaves():
    """A checkpointed block recomputes nodes used only inside it and saves its output."""
    b = blocks_of(4)
    p = policies.blocks()
    assert p(info(b[1], (b[1],))) == CheckpointPolicy.MUST_RECOMPUTE
    assert p(info(b[1], (b[1], b[2]))) == CheckpointPolicy.MUST_SAVE  # the block's output
    assert p(info(b[1], (None,))) == CheckpointPolicy.MUST_SAVE  # a graph output
    assert p(info(b[0], (b[0],))) == CheckpointPolicy.MUST_RECOMPUTE  # skip_first="auto": alike blocks, none skipped
    assert policies.blocks(skip_first=1)(info(b[0], (b[0],))) == CheckpointPolicy.PREFER_SAVE
    assert p(info(None, (b[0],), region="embedding")) == CheckpointPolicy.PREFER_SAVE
    assert p(info(None, (b[0],))) == CheckpointPolicy.PREFER_SAVE


def test_every_nth_block_is_the_article_loop():
    """blocks(every=4, skip_first=1) checkpoints exactly the blocks of `if i > 0 and i % 4 == 0`."""
    b = blocks_of(12)
    p = policies.blocks(every=4, skip_first=1)
    chosen = [i for i in range(12) if p(info(b[i], (b[i],))) == CheckpointPolicy.MUST_RECOMPUTE]
    assert chosen == [i for i in range(12) if i > 0 and i % 4 == 0]


def test_segments_group_consecutive_blocks():
    """32 blocks in segments of 4: only a node crossing a segment boundary is saved."""
    b = blocks_of(32)
    p = policies.segments(size=4)
    assert p(info(b[1], (b[2],))) == CheckpointPolicy.MUST_RECOMPUTE  # inside segment 0
    assert p(info(b[3], (b[4],))) == CheckpointPolicy.MUST_SAVE  # segment 0 -> 1
    saved = [i for i in range(31) if p(info(b[i], (b[i + 1],))) == CheckpointPolicy.MUST_SAVE]
    assert saved == [3, 7, 11, 15, 19, 23, 27]  # 8 segments


def test_sqrt_picks_segments_of_about_sqrt_l():
    b = blocks_of(16)
    p = policies.sqrt()
    saved = [i for i in range(15) if p(info(b[i], (b[i + 1],))) == CheckpointPolicy.MUST_SAVE]
    assert saved == [3, 7, 11]


def test_segments_never_span_two_stacks():
    enc, dec = blocks_of(2, "encoder.layer"), blocks_of(2, "decoder.layer")
    dec = [Block(path=d.path, stack=d.stack, index=d.index, stack_len=2, number=d.number + 2) for d in dec]
    p = policies.segments(size=4)
    assert p(info(enc[1], (dec[0],))) == CheckpointPolicy.MUST_SAVE
    assert p(info(enc[0], (enc[1],))) == CheckpointPolicy.MUST_RECOMPUTE


def test_only_in_restricts_a_policy_to_module_paths():
    b = blocks_of(4)
    p = policies.only_in("layers.2", policies.blocks(skip_first=0))
    assert p(info(b[2], (b[2],), path="layers.2.mlp.fc")) == CheckpointPolicy.MUST_RECOMPUTE
    assert p(info(b[1], (b[1],), path="layers.1.mlp.fc")) == CheckpointPolicy.PREFER_SAVE


def test_none_saves_everything():
    b = blocks_of(2)
    assert policies.none()(info(b[1], (b[1],))) == CheckpointPolicy.PREFER_SAVE


def test_graph_recomputes_everything_but_embeddings():
    """graph(): one graph is one unit, whatever regions found (FSDP2 compiles each block alone)."""
    b = blocks_of(2)
    p = policies.graph()
    assert p(info(b[0], (b[1],))) == CheckpointPolicy.MUST_RECOMPUTE
    assert p(info(None, (None,))) == CheckpointPolicy.MUST_RECOMPUTE
    assert p(info(None, (b[0],), region="embedding")) == CheckpointPolicy.PREFER_SAVE


def test_graph_on_one_compiled_block_saves_only_its_inputs():
    """A block compiled on its own: "graph" keeps out every activation of the block and gives
    eager's gradients, without the no-stack warning."""
    import warnings

    import torch

    from ckpt_fx.bench.models import build

    block = build("llama", layers=1, dim=64, heads=2).layers[0]
    x = torch.randn(2, 64, 64, requires_grad=True)
    cos, sin = torch.randn(64, 32), torch.randn(64, 32)
    block(x, cos, sin).square().sum().backward()
    eager = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad(set_to_none=True)
    x.grad = None
    backend = ckpt_fx.backend(policy="graph", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(block, backend=backend)(x, cos, sin).square().sum().backward()
    for got, want in zip([p.grad for p in block.parameters()] + [x.grad], eager, strict=True):
        torch.testing.assert_close(got, want)
    plan = backend.plans[0]
    assert plan.recomputed
    # Only the generator state torch's partitioner keeps to replay attention (an op tagged random,
    # called with dropout_p=0) is saved besides the inputs: far less than one activation.
    activation = x.numel() * x.element_size()
    assert sum(s.nbytes for s in plan.saved if not s.is_input) < activation / 4, [s.name for s in plan.saved]


def test_selective_saves_expensive_ops_and_recomputes_the_rest():
    import dataclasses

    b = blocks_of(3)
    p = policies.selective()
    mm = info(b[1], (b[1],))  # aten.mm.default inside block 1
    assert p(mm) == CheckpointPolicy.MUST_SAVE
    pointwise = dataclasses.replace(mm, op="aten.gelu.default", producer="aten.gelu.default")
    assert p(pointwise) == CheckpointPolicy.MUST_RECOMPUTE
    attention_out = dataclasses.replace(mm, op="getitem", producer="aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert p(attention_out) == CheckpointPolicy.MUST_SAVE
    assert p(dataclasses.replace(pointwise, user_blocks=(b[2],))) == CheckpointPolicy.MUST_SAVE  # leaves the block
    assert p(info(None, (b[0],), region="embedding")) == CheckpointPolicy.PREFER_SAVE
    by_path = policies.selective(save=["*.mlp.*"])
    assert by_path(dataclasses.replace(pointwise, module_path="layers.1.mlp.act")) == CheckpointPolicy.MUST_SAVE
    assert by_path(mm) == CheckpointPolicy.MUST_RECOMPUTE  # matmuls not listed: recomputed
    with pytest.raises(ValueError, match="save must be a non-empty list"):
        policies.selective(save=[])
    with pytest.raises(ValueError, match=r"save item 'foo' is not an op class; op classes: matmul.*\*\.foo"):
        policies.parse("selective:save=foo")
    with pytest.raises(ValueError, match="save item 'aten.not_an_op' names no aten op"):
        policies.selective(save=["aten.not_an_op"])
    assert policies.policy_name(policies.parse("selective:save=aten.mm+*.mlp.*")).startswith("selective(save=('aten.mm', '*.mlp.*')")


def test_selective_on_a_gpt_lowers_the_peak_with_little_recompute():
    import torch

    from ckpt_fx.bench.models import build

    torch.manual_seed(0)
    model = build("gpt", layers=3, dim=64, heads=2)
    ids = torch.randint(0, 1000, (2, 64))
    model(ids, ids).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    peaks, flops = {}, {}
    for spec in ("none", "selective", "blocks:every=1,skip_first=0"):
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        backend = ckpt_fx.backend(policy=spec, strict=True)
        torch.compile(model, backend=backend)(ids, ids).backward()
        for got, want in zip([p.grad for p in model.parameters()], eager, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        peaks[spec], flops[spec] = backend.plans[0].peak_bytes, backend.plans[0].recompute_flops
    assert peaks["blocks:every=1,skip_first=0"] < peaks["selective"] < 0.85 * peaks["none"]
    assert flops["selective"] < 0.1 * flops["blocks:every=1,skip_first=0"]  # no matmul recomputed


def test_only_in_refuses_a_budget_and_keeps_graphs_quiet_about_blocks():
    """Issue: only_in over a budget lost the budget's candidates (the backend then called the
    budget per node, warned and checkpointed nothing); only_in over graph() warned "no stack found"
    for a policy that does not use blocks. Now: refused at construction; no warning."""
    import warnings

    import torch

    from ckpt_fx.bench.models import build

    with pytest.raises(ValueError, match=r"only_in cannot wrap budget\(0.5\): a memory budget plans the whole graph"):
        policies.only_in("layers.*", "budget:0.5")
    block = build("llama", layers=1, dim=32, heads=2).layers[0]
    x = torch.randn(2, 16, 32, requires_grad=True)
    cos, sin = torch.randn(16, 16), torch.randn(16, 16)
    backend = ckpt_fx.backend(policy=policies.only_in("*", "graph"), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(block, backend=backend)(x, cos, sin).sum().backward()
    assert backend.plans[0].recomputed


def test_the_command_lines_help_and_fit_default_name_every_policy_form():
    """The command line writes its policy help and fit's default policies out (its --help must not
    import torch): every text form, budget included, is named there, and the default is fit's."""
    from ckpt_fx.__main__ import FIT_POLICIES, POLICY_HELP
    from ckpt_fx.fit import DEFAULT_POLICIES

    assert all(f'"{name}' in POLICY_HELP for name in [*policies._TEXT_FORMS, "budget"])
    assert FIT_POLICIES.split(";") == list(DEFAULT_POLICIES)
    assert all(form in policies.FORMS for form in (policies._TEXT_FORMS["sqrt"].shown, policies._BUDGET_SHOWN))
