"""Hugging Face models built from small configs (random weights): block stacks are found under
their own module paths and gradients equal eager's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ckpt_fx
from ckpt_fx.bench.setups import hf_checkpointing_enable
from passes.sizes import format_size

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
    assert all(bp.recomputed_ops > 0 for bp in blocks)  # skip_first="auto": alike blocks, every one checkpointed


def test_hf_checkpointing_is_replaced_not_doubled():
    """With HF's checkpointing already on (activation_checkpointing_enable), backend="ckpt" re-plans the traced
    checkpoint regions: the backward does about the work of ckpt alone, not a second recompute."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = llama().train()
    ids = torch.randint(0, 128, (2, 64))

    def backward_flops(fn):
        torch.manual_seed(5)
        loss = fn(input_ids=ids, labels=ids).loss
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        return counter.get_total_flops()

    def setup(gc: bool, ckpt: bool):
        m = copy.deepcopy(model)
        if gc:
            hf_checkpointing_enable(m, use_reentrant=False)
        fn = torch.compile(m, backend=ckpt_fx.backend(policy="blocks")) if ckpt else m
        backward_flops(fn)  # compile
        flops = backward_flops(fn)
        torch._dynamo.reset()
        return flops, [p.grad for p in m.parameters()]

    eager, eager_grads = setup(False, False)
    ckpt_only, _ = setup(False, True)
    both, grads = setup(True, True)
    recompute = ckpt_only - eager
    assert recompute > 0
    assert both < eager + 1.5 * recompute  # a second recompute would make it eager + 2 x recompute
    for g, r in zip(grads, eager_grads):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-6)


def test_replacing_hf_checkpointing_says_what_it_keeps_that_hf_did_not():
    """BERT with dropout and HF's checkpointing on: HF draws the masks again in the backward, the
    plan keeps them; the backend says so once, with their size and how to keep none."""
    torch.manual_seed(0)
    model = bert().train()
    hf_checkpointing_enable(model, use_reentrant=False)
    ids = torch.randint(0, 128, (2, 16))
    b = ckpt_fx.backend(policy="blocks", compiler="eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(model, backend=b)(input_ids=ids, labels=ids).loss.backward()
    said = [str(w.message) for w in record if "keeps their dropout masks" in str(w.message)]
    assert len(said) == 1 and "3 units itself" in said[0] and "dropout 0" in said[0]
    assert sum(s.nbytes for plan in b.plans for s in plan.saved if s.kind == "dropout mask") > 0


def test_enable_traces_the_plain_forward_where_hf_checkpointing_is_on_and_reports_its_units():
    """ckpt_fx.enable on a model with HF's checkpointing on (TRL's default): each compiled training
    call runs with the model's own flags off (its checkpoint function is never called, not even
    while dynamo traces) and use_cache=False, as HF's switch passes it; the plan names the layers
    HF's switch covered and recomputes each; afterwards the flags are on again, and the gradients
    equal those of HF's own checkpointing."""
    torch.manual_seed(0)
    model = llama().train()
    reference = copy.deepcopy(model)
    hf_checkpointing_enable(reference, use_reentrant=False)
    backend = ckpt_fx.enable(model, compiler="eager")
    hf_checkpointing_enable(model, use_reentrant=False)  # after enable, as trainers do
    calls = []
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in flagged:
        own = m._gradient_checkpointing_func
        m._gradient_checkpointing_func = lambda *a, _own=own, **k: calls.append(1) or _own(*a, **k)
    ids = torch.randint(0, 128, (2, 32))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
    assert not calls
    assert not [w for w in record if "KV cache" in str(w.message)]  # use_cache=False, as HF's switch passes
    assert [m.gradient_checkpointing for m in flagged] == [True] * len(flagged)
    (plan,) = backend.plans
    # A head one chunk covers runs beside the compiled backbone (Note [The loss head under
    # enable]): the units are named from the backbone.
    assert plan.checkpointed_by_model == ("layers.0", "layers.1", "layers.2")
    assert [b.path for b in plan.blocks if b.recomputed_ops] == list(plan.checkpointed_by_model)
    reference(input_ids=ids, labels=ids).loss.backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=1e-4, atol=1e-6)
    ckpt_fx.disable(model)


def test_enable_keeps_no_kv_cache_in_training_calls_unless_asked_for():
    """Note [A training step's KV cache]: a model enabled without HF's switch on, called the usual
    way in training, keeps no KV cache (as HF's switch passes use_cache=False); a caller who passes
    use_cache=True gets the cache, and the backend's warning names what it holds."""
    torch.manual_seed(0)
    model = llama().train()
    backend = ckpt_fx.enable(model, compiler="eager")
    ids = torch.randint(0, 128, (2, 32))

    def step(**kwargs):
        torch._dynamo.reset()
        backend.plans.clear()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = model(input_ids=ids, labels=ids, **kwargs)
            out.loss.backward()
        return out, [str(w.message) for w in record if "KV cache" in str(w.message)], backend.plans[0]

    out, said, plan = step()
    assert out.past_key_values is None and not said and not plan.held_outputs
    out, said, plan = step(use_cache=True)
    assert out.past_key_values is not None and len(said) == 1 and plan.held_outputs
    ckpt_fx.disable(model)


def test_enable_says_once_when_a_training_call_ran_uncompiled():
    """Note [A training call without its plan]: past dynamo's recompile limit a call runs
    uncompiled, with HF's own checkpointing switched off by enable; enable says so, once, with
    what to do; the calls before it say nothing."""
    import torch._dynamo.config as dynamo_config

    torch.manual_seed(0)
    model = llama().train()
    hf_checkpointing_enable(model, use_reentrant=False)
    ckpt_fx.enable(model, compiler="eager", dynamic=False)

    def said(length):
        ids = torch.randint(0, 128, (2, length))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model(input_ids=ids, labels=ids).loss.backward()
        return [str(w.message) for w in record if "ran uncompiled" in str(w.message)]

    with dynamo_config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        assert said(16) == []
        (message,) = said(24)
        assert "without the model's own gradient checkpointing of its 3 units" in message
        assert "recompile_limit = 1" in message and "enable(model, dynamic=True)" in message
        assert said(32) == []  # once
    ckpt_fx.disable(model)


def test_enable_and_disable_refuse_what_is_not_a_module():
    for call in (ckpt_fx.enable, ckpt_fx.disable, ckpt_fx.enabled):
        with pytest.raises(TypeError, match=r"expected a torch.nn.Module, got str"):
            call("x")


def test_hf_trainer_trains_a_model_compiled_in_place_and_saves_a_normal_checkpoint(tmp_path):
    """The HF Trainer trains a tiny Llama compiled in place with `model.compile(backend="ckpt")`
    (the README's path); the losses equal those of the run without checkpointing, and
    `save_model` writes a checkpoint `from_pretrained` reloads with the trained weights (a wrapper
    from `torch.compile(model)` would save every key as `_orig_mod.*`, and `from_pretrained`
    would return random weights without an error).

    TrainingArguments(torch_compile_backend="ckpt") itself is refused by accelerate, whose
    TorchDynamoPlugin accepts only the backends of its own DynamoBackend enum (pinned below)."""
    pytest.importorskip("accelerate")
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = llama().train()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 32), generator=g)]

    def train(compiled: bool):
        args = TrainingArguments(
            output_dir=str(tmp_path / str(compiled)), max_steps=3, per_device_train_batch_size=4,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
            dataloader_num_workers=0,
        )
        m = copy.deepcopy(model)
        if compiled:
            m.compile(backend="ckpt")
        trainer = Trainer(model=m, args=args, train_dataset=data)
        trainer.train()
        trainer.save_model(str(tmp_path / f"saved-{compiled}"))
        torch._dynamo.reset()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], m

    plain, _ = train(False)
    checkpointed, trained = train(True)
    assert len(plain) == len(checkpointed) == 3
    assert plain == pytest.approx(checkpointed, rel=1e-4)
    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved-True"))
    trained_state, start = trained.state_dict(), model.state_dict()
    assert set(reloaded.state_dict()) == set(trained_state)
    for key, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained_state[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(trained_state[k], start[k]) for k in start)  # it did train


def test_trainer_argument_torch_compile_backend_ckpt_is_refused_by_accelerate():
    """Pins the limitation documented above: when accelerate accepts "ckpt", this test fails and
    the README's Trainer section should switch to TrainingArguments(torch_compile_backend="ckpt")."""
    accelerate_utils = pytest.importorskip("accelerate.utils")
    with pytest.raises(ValueError, match="is not a valid DynamoBackend"):
        accelerate_utils.TorchDynamoPlugin(backend="ckpt")


def test_a_kv_cache_left_on_is_named_once_with_its_size_and_the_fix():
    """An HF causal LM called the usual way returns its KV cache: every block's keys and values
    stay alive whatever the policy. One warning says how many MB, where, and the fix; with
    use_cache=False there is none."""
    import warnings

    torch.manual_seed(0)
    model = llama().train()
    ids = torch.randint(0, 128, (2, 32))
    backend = ckpt_fx.backend(policy="blocks:every=1,skip_first=0", strict=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend=backend)
        compiled(input_ids=ids, labels=ids).loss.backward()
        compiled(input_ids=ids, labels=ids).loss.backward()
    held = [str(w.message) for w in record if "KV cache" in str(w.message)]
    assert len(held) == 1, held
    # through transformers' forward wrappers, the warning still names this file (the user's line)
    assert all(w.filename == __file__ for w in record if "KV cache" in str(w.message))
    assert "use_cache=False" in held[0] and "model.layers.1.self_attn" in held[0]
    total = sum(nbytes for _, nbytes in backend.plans[0].held_outputs)
    assert f"({format_size(total, digits=1)}; " in held[0] and total >= 2 * 2 * (2 * 32 * 16 * 4)  # k and v (batch x seq x 16 fp32) of 2 blocks at least
    assert backend.plans[0].held_outputs
    torch._dynamo.reset()
    quiet = ckpt_fx.backend(policy="blocks:every=1,skip_first=0", strict=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(model, backend=quiet)(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert not [w for w in record if "KV cache" in str(w.message)]
    assert not quiet.plans[0].held_outputs


def swin():
    cfg = transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[2, 2, 2], num_heads=[1, 2, 4],
                                  window_size=4, num_labels=10)
    return transformers.SwinForImageClassification(cfg)


def albert():
    cfg = transformers.AlbertConfig(vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    return transformers.AlbertForMaskedLM(cfg)


def resnet():
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[2, 2], layer_type="basic", num_labels=10)
    return transformers.ResNetForImageClassification(cfg)


@pytest.mark.parametrize("build, kind, units", [
    # Note [Nested stacks]: the blocks inside Swin's and ResNet's stages are the units.
    (swin, "image", ["swin.encoder.layers.0.blocks.0", "swin.encoder.layers.0.blocks.1", "swin.encoder.layers.1.blocks.0",
                     "swin.encoder.layers.1.blocks.1", "swin.encoder.layers.2.blocks.0", "swin.encoder.layers.2.blocks.1"]),
    (resnet, "image", ["resnet.encoder.stages.0.layers.0", "resnet.encoder.stages.0.layers.1",
                       "resnet.encoder.stages.1.layers.0", "resnet.encoder.stages.1.layers.1"]),
    # Note [Calls as units]: ALBERT's one shared layer group, run four times, is four units.
    (albert, "tokens", [f"albert.encoder.albert_layer_groups.0 #{k}" for k in range(4)]),
])
def test_stages_and_shared_layers_are_units_and_gradients_are_bitwise(build, kind, units):
    """Nested stacks and a module called several times: the units are the blocks and the calls;
    gradients (and BatchNorm's running statistics) equal eager's bitwise."""
    torch.manual_seed(0)
    model = build().train()
    if kind == "image":
        inputs = dict(pixel_values=torch.randn(2, 3, 64, 64), labels=torch.tensor([1, 2]))
    else:
        ids = torch.randint(0, 128, (2, 16))
        inputs = dict(input_ids=ids, labels=ids)

    def step(fn, m):
        torch.manual_seed(5)
        fn(**inputs).loss.backward()
        return [p.grad for p in m.parameters()], [b.clone() for b in m.buffers()]

    eager_model = copy.deepcopy(model)
    grads_ref, buffers_ref = step(eager_model, eager_model)
    # The MLM head's cross-entropy in chunks is bounded, not bitwise (tests/test_head.py).
    b = ckpt_fx.backend(policy="blocks", strict=True, compiler="eager", head="whole")
    grads, buffers = step(torch.compile(model, backend=b), model)
    for g, r in zip(grads, grads_ref):
        assert (g is None) == (r is None) and (g is None or torch.equal(g, r))
    assert all(torch.equal(x, y) for x, y in zip(buffers, buffers_ref))
    blocks = [bp for plan in b.plans for bp in plan.blocks]
    assert [bp.path for bp in blocks] == units
    assert all(bp.recomputed_ops > 0 for bp in blocks[1:])


def _mixtral_lora(*, frozen_experts: bool):
    """A tiny Mixtral (4 experts, top 2, fp32: transformers' own grouped-matmul op under compile),
    with peft LoRA on q/v (experts frozen) or every parameter trained."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(cfg).train()
    if frozen_experts:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


@pytest.mark.parametrize("frozen_experts", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_grouped_matmuls_unread_weight_gradient_is_not_computed_and_gradients_are_bitwise(frozen_experts, monkeypatch):
    """Note [A grouped matmul's unread weight gradient]: with frozen experts the backward computes
    the experts' input gradients by the forward op (transformers' backward op is gone from it), the
    routed inputs are no longer saved for it, and gradients are bitwise those of aot_eager, which
    runs transformers' backward op; with trained experts the backward op stays."""
    import passes.pipeline

    model = _mixtral_lora(frozen_experts=frozen_experts)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    trained = [p for p in model.parameters() if p.requires_grad]

    def grads(backend):
        torch._dynamo.reset()
        for p in trained:
            p.grad = None
        torch.compile(model, backend=backend)(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return [p.grad.clone() for p in trained]

    def saved_and_backward_ops(backend):
        graphs = []
        backend.on_partitioned.append(lambda record: graphs.append(record))
        got = grads(backend)
        ops = {str(n.target) for g in graphs for n in g.backward.graph.nodes if n.op == "call_function"}
        return got, sum(g.plan.saved_bytes for g in graphs), ops

    reference = grads("aot_eager")
    ours, saved, ops = saved_and_backward_ops(ckpt_fx.backend(policy="none", compiler="eager", strict=True, head="whole"))
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
    assert ("transformers.grouped_mm_fallback_backward.default" in ops) is not frozen_experts, sorted(ops)
    assert "transformers.grouped_mm_fallback.default" in ops or not frozen_experts
    checkpointed, _, _ = saved_and_backward_ops(ckpt_fx.backend(policy="blocks", compiler="eager", strict=True, head="whole"))
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, reference, strict=True))
    if frozen_experts:
        monkeypatch.setattr(passes.pipeline, "grouped_mm_pass", lambda gm: 0)
        _, saved_without, _ = saved_and_backward_ops(ckpt_fx.backend(policy="none", compiler="eager", strict=True, head="whole"))
        assert saved < saved_without, (saved, saved_without)


@pytest.mark.slow
def test_a_grouped_matmuls_input_gradient_alone_lowers_under_inductor(fresh_inductor_cache):
    """The forward op that stands in for transformers' grouped-matmul backward (Note [A grouped
    matmul's unread weight gradient]) lowers under Inductor, which lays a custom op's inputs out by
    their traced values; gradients equal eager's."""
    model = _mixtral_lora(frozen_experts=True)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    trained = [p for p in model.parameters() if p.requires_grad]

    def grads(fn):
        for p in trained:
            p.grad = None
        fn(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return [p.grad.clone() for p in trained]

    eager = grads(model)
    torch._dynamo.reset()
    backend = ckpt_fx.backend(policy="blocks", compiler="inductor", strict=True)
    graphs = []
    backend.on_partitioned.append(lambda record: graphs.append(record))
    for got, want in zip(grads(torch.compile(model, backend=backend)), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    ops = {str(n.target) for g in graphs for n in g.backward.graph.nodes if n.op == "call_function"}
    assert "transformers.grouped_mm_fallback.default" in ops and "transformers.grouped_mm_fallback_backward.default" not in ops
