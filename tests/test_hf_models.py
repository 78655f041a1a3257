"""Hugging Face models built from small configs (random weights): block stacks are found under
their own module paths and gradients equal eager's."""

from __future__ import annotations

import copy

import pytest
import torch

import ckpt_fx

transformers = pytest.importorskip("transformers")


def llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, max_position_embeddings=64, attn_implementation="eager")
    return transformers.BertForMaskedLM(cfg)


@pytest.mark.parametrize("build, stack", [(llama, "model.layers"), (bert, "bert.encoder.layer")])
def test_hf_model_blocks_are_found_and_gradients_match(build, stack):
    torch.manual_seed(0)
    model = build().train()
    ids = torch.randint(0, 128, (2, 16))

    def step(fn, m):
        torch.manual_seed(5)
        out = fn(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), [p.grad for p in m.parameters()]

    eager_model = copy.deepcopy(model)
    loss_ref, grads_ref = step(eager_model, eager_model)
    b = ckpt_fx.backend(policy="blocks", strict=True)
    loss, grads = step(torch.compile(model, backend=b), model)
    assert torch.allclose(loss, loss_ref, rtol=1e-5)
    for g, r in zip(grads, grads_ref):
        assert (g is None) == (r is None)
        if g is not None:
            assert torch.allclose(g, r, rtol=1e-4, atol=1e-6)
    blocks = [bp for plan in b.plans for bp in plan.blocks]
    assert [bp.path for bp in blocks] == [f"{stack}.{i}" for i in range(3)]
    assert blocks[0].recomputed_ops == 0 and all(bp.recomputed_ops > 0 for bp in blocks[1:])  # skip_first=1
