"""The cost model prices every op that computes (Note [Op classes] in passes/costs.py): walked over
the joint graphs of Hugging Face models with SDPA and eager attention, grouped-query attention,
mixtures of experts, a conv net and a windowed vision transformer."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import sdpa_flop_count

from ckpt_fx.dynamo_backend import CkptBackend, Options
from ckpt_fx.policies import parse
from passes.costs import FLOPS_KEY, costs_pass, is_view, node_flops, op_class, roofline_cost, tensor_bytes
from passes.graphs import copy_graph_module

transformers = pytest.importorskip("transformers")


def _causal(config: str, model: str, **extra):
    cfg = getattr(transformers, config)(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, **extra)
    ids = torch.randint(0, 128, (2, 16))
    return getattr(transformers, model)(cfg), dict(input_ids=ids, labels=ids)


def _image(config, model, **extra):
    return (getattr(transformers, model)(getattr(transformers, config)(num_labels=10, **extra)),
            dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.randint(0, 10, (2,))))


MODELS = {
    "llama-sdpa-gqa": lambda: _causal("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2),
    "llama-eager": lambda: _causal("LlamaConfig", "LlamaForCausalLM", attn_implementation="eager"),
    "mixtral": lambda: _causal("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2),
    "bert": lambda: _causal("BertConfig", "BertForMaskedLM"),
    "resnet": lambda: _image("ResNetConfig", "ResNetForImageClassification", embedding_size=8, hidden_sizes=[16, 32],
                             depths=[1, 1], layer_type="bottleneck"),
    "swin": lambda: _image("SwinConfig", "SwinForImageClassification", image_size=32, patch_size=4, embed_dim=16,
                           depths=[1, 1], num_heads=[1, 2], window_size=4),
}


def _joints(name: str) -> list[torch.fx.GraphModule]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, batch = MODELS[name]()
    backend = CkptBackend(Options(policy=parse("none"), compiler="eager"))
    joints = []
    backend.on_joint.append(lambda joint, inputs, kw: joints.append(costs_pass(copy_graph_module(joint))))
    torch.compile(model, backend=backend)(**batch).loss.backward()
    return joints


def _packet(node: torch.fx.Node) -> str:
    return str(getattr(node.target, "overloadpacket", node.target))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_op_that_computes_has_a_price(name):
    """No op with tensor inputs is free to recompute on either roofline, fused or not; every op of
    a computing class (matrix products, convolutions, attention, their backward kernels) has FLOPs."""
    computing = set()
    for joint in _joints(name):
        for node in joint.graph.nodes:
            if node.op != "call_function" or is_view(node) or not hasattr(node.target, "overloadpacket"):
                continue
            packet = _packet(node)
            if any(tensor_bytes(a.meta.get("val")) > 0 for a in node.all_input_nodes):
                for device in ("cpu", "cuda"):
                    for fused in (False, True):
                        assert roofline_cost(node, device, fused=fused) > 0, (packet, device, fused)
            if op_class(packet.removesuffix("_backward")) is not None:
                computing.add(packet)
                assert node.meta[FLOPS_KEY] > 0, (name, packet)
    assert computing, f"{name}: no matrix product, convolution or attention found"


def test_sdpa_on_a_cpu_and_grouped_query_attention_are_counted_as_torch_counts_sdpa():
    """torch's counter has no formula for the CPU flash kernel; ours equals its SDPA formula with
    the key and value heads repeated to the query's (what grouped-query attention computes)."""
    joints = _joints("llama-sdpa-gqa")
    nodes = [n for j in joints for n in j.graph.nodes if _packet(n).startswith("aten._scaled_dot_product")]
    forward = [n for n in nodes if not _packet(n).endswith("_backward")]
    assert forward and len(nodes) > len(forward)
    for node in forward:
        q, k, v = (a.meta["val"] for a in node.args[:3])
        assert k.shape[1] < q.shape[1]  # grouped-query: fewer key heads
        repeated = [q.shape[0], q.shape[1], k.shape[2], k.shape[3]], [q.shape[0], q.shape[1], v.shape[2], v.shape[3]]
        assert node_flops(node) == sdpa_flop_count(q.shape, *repeated)


def test_selective_saves_every_attention_kernel_and_grouped_matmul():
    """selective()'s classes match by name pattern: every attention kernel, a library's grouped
    matmul; never a backward kernel or a pointwise op."""
    for producer in ("aten._scaled_dot_product_flash_attention_for_cpu.default",
                     "aten._scaled_dot_product_fused_attention_overrideable.default",
                     "aten._efficient_attention_forward.default", "transformers.grouped_mm_fallback.default",
                     "aten.mm.default"):
        assert op_class(producer.rsplit(".", 1)[0]) is not None, producer
    assert op_class("aten.add") is None and op_class("aten._scaled_dot_product_flash_attention_for_cpu_backward") is None


def test_fused_costs_price_a_pointwise_recompute_as_its_reads_and_a_matmul_as_before():
    """Under Inductor a recomputed pointwise op costs its extra reads (no launch, no write); a
    matmul costs its roofline time either way."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w: torch.mm(torch.relu(x), w))(torch.randn(64, 64), torch.randn(64, 64))
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    relu, mm = nodes[torch.ops.aten.relu.default], nodes[torch.ops.aten.mm.default]
    assert 0 < roofline_cost(relu, "cpu", fused=True) < roofline_cost(relu, "cpu") / 2
    assert roofline_cost(mm, "cpu", fused=True) == roofline_cost(mm, "cpu")
