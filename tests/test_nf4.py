"""A 4-bit NF4 base (QLoRA): fit's stand-in holds and computes what bitsandbytes does, its
prediction against a measured step of bitsandbytes' own layers, and ckpt on such a model."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from ckpt_fx.fit import fit, measured_step_peak
from ckpt_fx.nf4 import NF4Linear, quantize_frozen


def _bitsandbytes():
    """bitsandbytes, or a skip where it is not installed (it is not a test dependency: peft imports
    it whenever it is present, which slows every test that uses peft). CI's lane that installs it
    sets CKPT_FX_NEED_BITSANDBYTES, so these checks cannot be skipped there."""
    if os.environ.get("CKPT_FX_NEED_BITSANDBYTES"):
        import bitsandbytes

        return bitsandbytes
    return pytest.importorskip("bitsandbytes")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _bnb_quantized(model: torch.nn.Module) -> torch.nn.Module:
    """Every linear layer but the output head as bitsandbytes' Linear4bit (NF4, double
    quantisation, bf16 compute), as transformers loads a model with load_in_4bit."""
    bnb = _bitsandbytes()
    for name, child in list(model.named_children()):
        if type(child) is torch.nn.Linear and name != "lm_head":
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)
            setattr(model, name, layer.to("cpu"))  # quantises
        else:
            _bnb_quantized(child)
    return model


def _quant_states(model: torch.nn.Module) -> list[torch.Tensor]:
    import bitsandbytes as bnb

    out = []
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            s = m.weight.quant_state
            out += [s.absmax, s.code, s.offset, s.state2.absmax, s.state2.code]
    return out


def test_the_4bit_layer_holds_and_computes_what_bitsandbytes_does():
    """The same bytes as bitsandbytes' packed weight and quantisation state, and, loaded with
    that state, the same dequantised matrix."""
    _bitsandbytes()
    import bitsandbytes.functional as bf

    torch.manual_seed(0)
    weight = torch.randn(96, 200)  # 19200 values: 300 blocks of 64, two nested blocks (the last partial)
    packed, state = bf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    ours = NF4Linear(200, 96, compute_dtype=torch.float32)
    theirs = [packed, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
    assert _nbytes([*ours.parameters(), *ours.buffers()]) == _nbytes(theirs)
    with torch.no_grad():
        for mine, value in zip((ours.weight, ours.absmax, ours.code, ours.offset, ours.nested_absmax, ours.nested_code),
                               theirs):
            mine.copy_(value.reshape(mine.shape))
    assert torch.equal(ours.dequantize(), bf.dequantize_4bit(packed, state))
    x = torch.randn(3, 200, requires_grad=True)
    ours(x).sum().backward()
    torch.testing.assert_close(x.grad, bf.dequantize_4bit(packed, state).sum(0).expand(3, 200))


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=500, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def test_a_4bit_base_under_lora_is_predicted_within_ten_percent_of_a_bitsandbytes_step():
    """fit(dtype="nf4") on the model in bf16 against a real step of the same model loaded as
    bitsandbytes holds it (Linear4bit, LoRA on every linear layer, bf16 autocast)."""
    _bitsandbytes()
    peft = pytest.importorskip("peft")
    base = _tiny_llama()
    config = peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0)
    quantized = peft.get_peft_model(_bnb_quantized(copy.deepcopy(base).to(torch.bfloat16)), config)
    ids = torch.randint(0, 500, (4, 64))
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    policy = "blocks:every=1,skip_first=0"
    report = fit(peft.get_peft_model(base, config), memory="1GiB", policies=(policy,), device="cpu",
                 precision="bf16-mixed", dtype="nf4", **kwargs)
    held = _nbytes([*quantized.parameters(), *quantized.buffers(), *_quant_states(quantized)])
    assert report.rows[0].weights_bytes == held and report.weights_dtype == "nf4"
    assert report.parameters == sum(p.numel() for p in base.parameters())
    # The quantisation state is neither a parameter nor a buffer: the measure does not count it.
    measured = measured_step_peak(quantized, (), kwargs, policy=policy, precision="bf16-mixed") + _nbytes(
        _quant_states(quantized))
    assert abs(report.rows[0].peak_bytes - measured) <= 0.10 * measured, (report.rows[0].peak_bytes, measured)


def test_ckpt_on_a_bitsandbytes_model_keeps_the_adapters_gradients():
    """enable on a QLoRA model (bf16 base): traced through bitsandbytes' 4-bit product, planned,
    and the adapters' gradients equal those of the same inner compiler without checkpointing
    (eager's differ from both alike, by bf16's rounding in the traced ops)."""
    _bitsandbytes()
    peft = pytest.importorskip("peft")
    import ckpt_fx

    model = peft.get_peft_model(_bnb_quantized(_tiny_llama().to(torch.bfloat16)),
                                peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    ids = torch.randint(0, 500, (2, 32))
    checkpointed = copy.deepcopy(model)
    ckpt_fx.enable(checkpointed, "blocks:every=1,skip_first=0", compiler="eager")
    for m in (torch.compile(model, backend="aot_eager"), checkpointed):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(torch.equal(grads[n], p.grad) for n, p in checkpointed.named_parameters() if p.requires_grad)
    assert ckpt_fx.enabled(checkpointed).plans


def test_only_the_frozen_base_is_quantized_and_a_model_without_one_is_refused():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert quantize_frozen(model) == 2 * 7
    assert not any(isinstance(m, NF4Linear) for n, m in model.named_modules() if "lm_head" in n or "lora_" in n)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if not p.requires_grad
               and p.is_floating_point())
    with pytest.raises(ValueError, match="no frozen torch.nn.Linear layer to hold in 4 bits"):
        quantize_frozen(torch.nn.Sequential(torch.nn.Linear(4, 4)))  # trained: nothing to quantise


def test_when_nothing_fits_a_4bit_base_is_suggested_with_the_weights_it_would_plan():
    peft = pytest.importorskip("peft")
    from ckpt_fx.nf4 import weights_as_4bit
    from passes.sizes import format_size

    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, target_modules="all-linear"))
    expected = weights_as_4bit(model)
    quantized = copy.deepcopy(model)
    quantize_frozen(quantized)
    assert expected == _nbytes([*quantized.parameters(), *quantized.buffers()]) < _nbytes(
        [*model.parameters(), *model.buffers()])
    ids = torch.randint(0, 500, (2, 32))
    report = fit(model, input_ids=ids, labels=ids, use_cache=False, memory="1MiB", policies=("blocks",), device="cpu")
    assert report.best is None
    assert f"would fit: a 4-bit base (--dtype nf4, QLoRA): weights {format_size(expected)}" in str(report)
