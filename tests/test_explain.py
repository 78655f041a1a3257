"""explain(): the report per block, the saved tensors, the peaks and the pitfall warnings."""

from __future__ import annotations

import pytest
import torch

import ckpt_fx
from ckpt_fx import CheckpointPolicy, policies
from ckpt_fx.bench.models import build


def small():
    torch.manual_seed(0)
    model = build("gpt", layers=4, dim=64, heads=2, dropout=0.1).train()
    ids = torch.randint(0, 1000, (2, 64))
    return model, ids


def test_report_lists_blocks_saved_tensors_and_peaks(monkeypatch):
    import passes.head

    monkeypatch.setattr(passes.head, "WIDE", 10**9)  # the head whole: its logits' views are the rows checked below
    model, ids = small()
    before = [p.clone() for p in model.parameters()]
    report = ckpt_fx.explain(model, ids, ids, policy="blocks:every=1,skip_first=1", measure=True)
    text = str(report)
    for i in range(4):
        assert f"| blocks.{i} |" in text
    saved = text.split("saved activations:")[1].split("predicted peak:")[0]
    assert "blocks.0.ln_1" in saved  # block 0 is not checkpointed: its insides are kept
    assert "blocks.2.ln_1" not in saved  # block 2 is: only its output is
    assert report.measured_peak_bytes and report.eager_peak_bytes
    assert report.measured_peak_bytes < report.eager_peak_bytes
    assert abs(report.predicted_peak_bytes - report.measured_peak_bytes) <= 0.15 * report.measured_peak_bytes
    assert "predicted peak:" in text and "measured:" in text
    # The baseline without measuring: the same graphs planned without checkpointing, within 15% of
    # eager's measured peak, and above the plan's.
    assert report.predicted_peak_bytes < report.no_checkpoint_peak_bytes
    assert abs(report.no_checkpoint_peak_bytes - report.eager_peak_bytes) <= 0.15 * report.eager_peak_bytes
    assert "predicted without checkpointing)" in text
    assert "native_dropout[1] (dropout mask)" in saved  # what is no activation says so
    # A saved view of a saved value shows no bytes of its own (they are its base's row); a view
    # saved without its base shows them.
    rows = [s for plan in report.plans for s in plan.saved if not s.is_input]
    names = {s.name for s in rows}
    shared = [s for s in rows if s.view_of in names]
    assert shared and all(f"view of {s.view_of}" in saved for s in shared)
    assert all(" MB" not in line for line in saved.splitlines() if "view of " in line)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and all(p.grad is None for p in model.parameters())


def test_saved_values_that_are_no_activations_are_named():
    from passes.plan import SavedTensor

    def kind(op: str) -> str:
        return SavedTensor(name="x", module_path="", block=None, op=op, shape=(), dtype=None, nbytes=1, is_input=False).kind

    assert kind("inductor_seeds") == "random-number state"
    assert kind("detach(run_and_save_rng_state[0])") == "random-number state"
    assert kind("gt(inductor_random)") == kind("native_dropout[1]") == "dropout mask"
    assert kind("native_layer_norm[1]") == "activation"


@pytest.mark.slow
def test_dropout_under_inductor_says_its_masks_are_inductors_own():
    model, ids = small()
    said = [w for w in ckpt_fx.explain(model, ids, ids, compiler="inductor").warnings if "dropout under Inductor" in w]
    assert len(said) == 1 and "fallback_random = True" in said[0]
    assert not any("dropout under Inductor" in w for w in ckpt_fx.explain(model, ids, ids, compiler="eager").warnings)


def test_attention_without_dropout_under_inductor_is_not_called_dropout():
    """SDPA called with dropout_p=0 draws nothing; torch 2.13's partitioners still save the
    generator's state beside it when it is recomputed. That state is no dropout to warn of."""
    from passes._compat import PARTITIONER_KNOWS_SDPA_WITHOUT_DROPOUT

    torch.manual_seed(0)
    model = build("llama", layers=3, dim=64, heads=2).train()
    ids = torch.randint(0, 1000, (2, 64))
    report = ckpt_fx.explain(model, ids, ids, compiler="inductor")
    assert not any("dropout under Inductor" in w for w in report.warnings)
    states = [s for plan in report.plans for s in plan.saved if s.kind == "random-number state"]
    if not PARTITIONER_KNOWS_SDPA_WITHOUT_DROPOUT:
        assert states and all(s.draws_nothing for s in states)  # kept, and known to stand for no draw


def test_policy_that_matches_nothing_warns():
    model, ids = small()
    report = ckpt_fx.explain(model, ids, ids, policy=policies.only_in("decoder.*", "blocks"))
    assert any("recomputes nothing: no node matched it" in w and "blocks.0" in w for w in report.warnings)


def test_recomputing_an_embedding_warns():
    def everything(info):
        return CheckpointPolicy.PREFER_RECOMPUTE

    model, ids = small()
    report = ckpt_fx.explain(model, ids, ids, policy=everything)
    assert any("embedding op(s): this saves nothing" in w for w in report.warnings)


def test_tiny_regions_warn_that_recompute_costs_more_than_it_saves():
    torch.manual_seed(0)
    model = build("gpt", layers=3, dim=8, heads=2).train()
    ids = torch.randint(0, 1000, (1, 4))
    report = ckpt_fx.explain(model, ids, ids, policy="blocks")
    assert any("to keep out only" in w for w in report.warnings)
    model, ids = small()
    assert not any("to keep out only" in w for w in ckpt_fx.explain(model, ids, ids, policy="blocks").warnings)


def test_explain_leaves_the_process_as_it_found_it():
    """explain() neither resets dynamo (a model the user compiled stays compiled: no second
    compile) nor moves the random number generator; it says which inner compiler it planned for."""
    from ckpt_fx.bench.models import build

    torch.manual_seed(0)
    user_model = build("gpt", layers=2, dim=32, heads=2)
    ids = torch.randint(0, 1000, (2, 16))
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    user_compiled = torch.compile(user_model, backend=counting)
    user_compiled(ids, ids)
    assert len(compiles) == 1
    other = build("gpt", layers=2, dim=32, heads=2)
    state = torch.get_rng_state()
    report = ckpt_fx.explain(other, ids, ids, policy="blocks", compiler="eager")
    assert torch.equal(torch.get_rng_state(), state)
    user_compiled(ids, ids)
    assert len(compiles) == 1, "explain() discarded the user's compiled model"
    assert report.compiler == "eager" and "inner compiler eager" in str(report) and report.plans


def test_explain_names_each_call_of_a_shared_layer_as_a_unit():
    """Note [Calls as units]: a layer run three times reads as three units in the report."""

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))])

        def forward(self, x):
            for _ in range(3):
                x = x + self.layers[0](x)
            return x.square().mean()

    report = ckpt_fx.explain(Shared(), torch.randn(8, 16), policy="blocks:every=1,skip_first=0", compiler="eager")
    text = str(report)
    assert "| layers.0 #0 |" in text and "| layers.0 #2 |" in text
    assert "units: layers.0 runs 3 times: each call is a unit (layers.0 #0 .. #2)" in text
    assert all(b.recomputed_ops > 0 for plan in report.plans for b in plan.blocks)


def test_a_hugging_face_models_logging_call_does_not_split_explains_graph_and_no_backward_runs():
    """Note [Logging calls under explain]: GPT-2's loss_function calls transformers' warning_once
    on every forward, where Dynamo would break the graph (the blocks and the loss planned as two
    graphs); explain traces it as a no-op, and runs the forward only when it does not measure
    (the input's gradient stays None)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 100, (2, 16))
    embeds = torch.randn(2, 16, 32, requires_grad=True)
    report = ckpt_fx.explain(model, inputs_embeds=embeds, labels=ids, use_cache=False,
                             policy="blocks:every=1,skip_first=0", compiler="eager")
    assert len(report.plans) == 1, [p.units for p in report.plans]
    assert [b.path for b in report.plans[0].blocks] == ["transformer.h.0", "transformer.h.1"]
    assert embeds.grad is None, "explain ran a backward without measuring"
    measured = ckpt_fx.explain(model, inputs_embeds=embeds, labels=ids, use_cache=False, compiler="eager", measure=True)
    assert len(measured.plans) == 1 and measured.measured_peak_bytes and embeds.grad is not None


def test_explain_on_an_enabled_model_reports_the_plain_models_blocks_and_leaves_it_enabled():
    """explain copies the model: an enabled one is copied as the plain model it wraps (its own
    forwards), so its units are named by the model's paths, not by the wrapper dynamo inlined, and
    the eager step measured beside it is the plain model's; the model stays enabled, its backend's
    plans untouched."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 100, (2, 16))
    backend = ckpt_fx.enable(model, compiler="eager", progress=False)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    plans = list(backend.plans)
    report = ckpt_fx.explain(model, input_ids=ids, labels=ids, use_cache=False, policy="blocks", compiler="eager",
                             measure=True)
    assert [b.path for b in report.plans[0].blocks] == ["model.layers.0", "model.layers.1"]
    assert report.measured_peak_bytes and report.eager_peak_bytes
    assert ckpt_fx.enabled(model) is backend and backend.plans == plans
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # still compiled: no new graph
    assert backend.plans == plans
