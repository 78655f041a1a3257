"""regions_pass on tiny hand-built graphs: one invariant each."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt_fx

from passes.regions import PATH_KEY, REGION_KEY, normalize_module_path, regions_pass


class Blk(nn.Module):
    pass


class Expert(nn.Module):
    pass


class Stage(nn.Module):
    pass


def graph_of(paths: list[list[tuple[str, type]]], reads: dict[int, tuple[int, ...]] | None = None,
             calls: dict[int, dict[int, int]] | None = None) -> torch.fx.GraphModule:
    """Node i inside the module stack paths[i] (outermost first). Node i reads node i-1 (a chain;
    -1 is the input) unless reads[i] names the nodes it adds up; calls[i][j] marks the j-th module
    of node i's stack as that module's calls[i][j]-th call, as dynamo's "@k" key suffix does."""
    g = torch.fx.Graph()
    nodes = [g.placeholder("x")]
    for i, stack in enumerate(paths):
        args = [nodes[k + 1] for k in (reads or {}).get(i, (i - 1,))]
        x = g.call_function(torch.relu, (args[0],)) if len(args) == 1 else g.call_function(torch.add, tuple(args))
        call = (calls or {}).get(i, {})
        x.meta["nn_module_stack"] = {f"k{i}_{j}" + (f"@{call[j]}" if call.get(j) else ""): (p, c) for j, (p, c) in enumerate(stack)}
        nodes.append(x)
    g.output(nodes[-1])
    return torch.fx.GraphModule(nn.Module(), g)


def regions(gm):
    return [n.meta.get(REGION_KEY) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    "source, path",
    [
        ("L['self'].transformer.h[3].mlp", "transformer.h.3.mlp"),
        ("L['self']._modules['layers']._modules['0']", "layers.0"),
        ("getattr(L['self'].model.layers, '2')", "model.layers.2"),
        ("L['mod'].blocks.1", "blocks.1"),
        ("layers.0.ln", "layers.0.ln"),
        ("L['self']", ""),
        ("L['args'][0].model.layers.0", "model.layers.0"),
    ],
)
def test_normalize_module_path(source, path):
    """Dynamo's source strings and symbolic_trace's paths normalise to one form."""
    assert normalize_module_path(source) == path


def test_hf_style_stack_and_embedding():
    """transformer.h.N is a stack; the embedding and the final norm are not blocks."""
    gm = graph_of([
        [("transformer.wte", nn.Embedding)],
        [("transformer.h.0", Blk), ("transformer.h.0.attn", nn.Linear)],
        [("transformer.h.1", Blk)],
        [("transformer.h.2", Blk)],
        [("transformer.ln_f", nn.LayerNorm)],
    ])
    found = regions_pass(gm)
    assert found.stacks == ("transformer.h",) and not found.top_level_units
    r = regions(gm)
    assert r[0].kind == "embedding"
    assert [x.block.index for x in r[1:4]] == [0, 1, 2] and r[1].block.stack_len == 3
    assert r[4].kind == "other"
    assert [n.meta[PATH_KEY] for n in gm.graph.nodes if n.op == "call_function"][1] == "transformer.h.0.attn"


def test_encoder_and_decoder_are_two_stacks_numbered_in_forward_order():
    gm = graph_of([
        [("encoder.layer.0", Blk)], [("encoder.layer.1", Blk)],
        [("decoder.layer.0", Blk)], [("decoder.layer.1", Blk)],
    ])
    found = regions_pass(gm)
    assert found.stacks == ("encoder.layer", "decoder.layer")
    assert [(b.stack, b.index, b.number) for b in found.blocks] == [
        ("encoder.layer", 0, 0), ("encoder.layer", 1, 1), ("decoder.layer", 0, 2), ("decoder.layer", 1, 3)]


def test_stack_nested_in_a_block_is_not_a_stack():
    """Experts inside a block run side by side (each reads the block's input, none another
    expert's output): they belong to their block."""
    gm = graph_of([
        [("layers.0", Blk)], [("layers.0", Blk), ("layers.0.experts.0", Expert)], [("layers.0", Blk), ("layers.0.experts.1", Expert)],
        [("layers.0", Blk)],
        [("layers.1", Blk), ("layers.1.experts.0", Expert)], [("layers.1", Blk), ("layers.1.experts.1", Expert)],
        [("layers.1", Blk)],
    ], reads={1: (0,), 2: (0,), 3: (1, 2), 4: (3,), 5: (3,), 6: (4, 5)})
    found = regions_pass(gm)
    assert found.stacks == ("layers",) and found.nested_in == ()
    assert [r.block.path for r in regions(gm)] == ["layers.0"] * 4 + ["layers.1"] * 3


def test_blocks_run_in_sequence_inside_stages_are_the_units():
    """Note [Nested stacks]: blocks inside stages, each reading the one before, are the units; a
    stage's downsampling joins the block before it in its stage (or after, when it comes first)."""
    gm = graph_of([
        [("stages.0", Stage), ("stages.0.layers.0", Blk)], [("stages.0", Stage), ("stages.0.layers.1", Blk)],
        [("stages.0", Stage), ("stages.0.down", nn.Conv2d)],
        [("stages.1", Stage), ("stages.1.down", nn.Conv2d)],
        [("stages.1", Stage), ("stages.1.layers.0", Blk)], [("stages.1", Stage), ("stages.1.layers.1", Blk)],
        [("stages.1", Stage), ("stages.1.layers.2", Blk)],
    ])
    found = regions_pass(gm)
    assert found.nested_in == ("stages",) and found.stacks == ("stages.0.layers", "stages.1.layers")
    assert all(b.in_stage for b in found.blocks)
    assert [r.block.path for r in regions(gm)] == [
        "stages.0.layers.0", "stages.0.layers.1", "stages.0.layers.1", "stages.1.layers.0", "stages.1.layers.0",
        "stages.1.layers.1", "stages.1.layers.2"]
    assert [(b.index, b.number, b.stack_len) for b in found.blocks] == [(0, 0, 2), (1, 1, 2), (0, 2, 3), (1, 3, 3), (2, 4, 3)]


def test_a_module_called_several_times_is_one_unit_per_call():
    """Note [Calls as units]: ALBERT's one layer group run three times makes three units,
    numbered in forward order and named with their call."""
    stack = [("encoder.groups.0", Blk), ("encoder.groups.0.layers.0", Blk)]
    gm = graph_of([[("embeddings", nn.Embedding)], stack, stack, stack, stack],
                  calls={2: {0: 1, 1: 1}, 3: {0: 2, 1: 2}, 4: {0: 2, 1: 2}})
    found = regions_pass(gm)
    assert found.stacks == ("encoder.groups",)
    assert [(b.name, b.index, b.number, b.stack_len) for b in found.blocks] == [
        ("encoder.groups.0 #0", 0, 0, 3), ("encoder.groups.0 #1", 1, 1, 3), ("encoder.groups.0 #2", 2, 2, 3)]
    assert [r.block.call for r in regions(gm)[1:]] == [0, 1, 2, 2]


def test_a_unit_much_larger_than_the_median_is_heavy():
    """Note [What skip_first skips]: a unit computing over twice the median unit's bytes is heavy."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for i, n in enumerate((64, 8, 8, 8)):
        x = g.call_function(torch.relu, (x,))
        x.meta["nn_module_stack"] = {"k": (f"layers.{i}", Blk)}
        x.meta["val"] = torch.empty(n, 4)
    g.output(x)
    found = regions_pass(torch.fx.GraphModule(nn.Module(), g))
    assert [(b.activation_bytes, b.heavy) for b in found.blocks] == [(1024, True), (128, False), (128, False), (128, False)]


def test_plain_sequential_at_the_top():
    gm = graph_of([[("0", Blk)], [("1", Blk)], [("2", Blk)]])
    found = regions_pass(gm)
    assert found.stacks == ("",) and [b.path for b in found.blocks] == ["0", "1", "2"]


def test_mixed_children_are_not_a_stack_and_top_level_children_become_units():
    """No repeated class: top-level children are the units, with one warning saying so."""
    gm = graph_of([[("0", nn.Linear)], [("1", nn.ReLU)], [("2", nn.Linear)]])
    with pytest.warns(UserWarning, match=r"no stack of repeated blocks.*\(0, 1, 2\)"):
        found = regions_pass(gm)
    assert found.top_level_units and [b.path for b in found.blocks] == ["0", "1", "2"]


def test_a_graph_of_one_leaf_module_is_not_warned_of():
    """The loss head's graph after a graph break (a Linear and the loss's functions) has no block
    to name: it is planned with that module as its unit, quietly. A lone module with modules
    inside it is still warned of (the user can name its blocks)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = regions_pass(graph_of([[("lm_head", nn.Linear)], [], []]))
    assert [b.path for b in found.blocks] == ["lm_head"] and not found.top_level_units  # explain quiet too
    with pytest.warns(UserWarning, match=r"no stack of repeated blocks.*\(encoder\)"):
        regions_pass(graph_of([[("encoder", Blk), ("encoder.proj", nn.Linear)], [("encoder", Blk)]]))


def test_node_without_module_stack_is_other():
    gm = graph_of([[("layers.0", Blk)], [], [("layers.1", Blk)]])
    regions_pass(gm)
    assert [r.kind for r in regions(gm)] == ["block", "other", "block"]


def test_a_graph_holding_one_block_of_a_stack_still_finds_it():
    """DDP's bucket split or a graph break can leave one block in a graph: it keeps its index."""
    gm = graph_of([[("model.layers.5", Blk)], [("model.norm", nn.LayerNorm)], [("lm_head", nn.Linear)]])
    found = regions_pass(gm)
    assert not found.top_level_units
    assert [(b.path, b.index, b.number) for b in found.blocks] == [("model.layers.5", 5, 5)]


def test_a_model_with_no_blocks_and_no_submodules_is_told_its_policy_recomputes_nothing():
    """torch.compile(model, backend="ckpt") on ops with no module around them: the block policy
    has nothing to act on, and says so once with the policies that plan without blocks; a policy
    that plans op by op says nothing."""
    import warnings

    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return torch.tanh(torch.tanh(x @ self.w) @ self.w).sum()

    def said(policy):
        torch._dynamo.reset()
        fn = torch.compile(Bare(), backend=ckpt_fx.backend(policy=policy, compiler="eager"))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fn(torch.randn(4, 16)).backward()
        return [str(w.message) for w in record if "found no blocks" in str(w.message)]

    (message,) = said("blocks")
    assert "recomputes nothing here" in message and "Policy 'graph' or a budget" in message
    assert said("graph") == []


def test_a_models_own_switch_checkpoints_its_flagged_layers_or_its_flagged_parents_stacks():
    """enable reads which units a model's own checkpointing covered: the flagged layers (Hugging
    Face's GradientCheckpointingLayer), or where only a parent is flagged (older models' loops),
    the layers of the stacks under it, found as block_stacks finds them; the flags are back after."""
    from ckpt_fx.in_place import _own_checkpointing_off

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(2, 2)
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.heads = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # two classes: no stack

    model = nn.ModuleDict({"decoder": Decoder(), "head": nn.Linear(2, 2)})
    model["decoder"].gradient_checkpointing = True
    with _own_checkpointing_off(model) as units:
        assert units == ("decoder.layers.0", "decoder.layers.1", "decoder.layers.2")
        assert model["decoder"].gradient_checkpointing is False
    assert model["decoder"].gradient_checkpointing is True
    del model["decoder"].gradient_checkpointing
    for layer in model["decoder"].layers[:2]:
        layer.gradient_checkpointing = True
    with _own_checkpointing_off(model) as units:
        assert units == ("decoder.layers.0", "decoder.layers.1")
    with _own_checkpointing_off(model["decoder"].layers) as units:
        assert units == ("0", "1")
