"""The loss head in chunks (passes/head.py): found, rewritten, exact to a stated bound, measured."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt_fx
import passes.head as head
from ckpt_fx.bench.models import build

VOCAB, WIDTH = 96, 16


class TinyLM(torch.nn.Module):
    """An embedding, one hidden layer, a vocabulary head (tied to the embedding or not) and a plain
    cross-entropy over the flattened logits."""

    def __init__(self, *, tied: bool, upcast: bool, reduction: str, smoothing: float = 0.0):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.upcast, self.reduction, self.smoothing = upcast, reduction, smoothing

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        if self.upcast:
            logits = logits.float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                               reduction=self.reduction, label_smoothing=self.smoothing)


def _step(model, fn, ids, labels, *, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(ids, labels)
    loss.backward()
    return [loss.detach().double()] + [p.grad.double() for p in model.parameters()]


def _errors(got, ref):
    return [(g - r).abs().max().item() for g, r in zip(got, ref, strict=True)]


def _per_row(dtype: torch.dtype) -> int:
    return head.row_bytes(vocab=VOCAB, dtype=dtype)


def _check_bound(*, batch, seq, rows, ignored, tied, autocast, upcast, reduction, compiler, monkeypatch):
    """Loss and every gradient of a chunked step within twice the whole step's error against the
    same step in float64, plus EPS times the float64 value's largest magnitude."""
    torch.manual_seed(0)
    model = TinyLM(tied=tied, upcast=upcast, reduction=reduction)
    ids = torch.randint(0, VOCAB, (batch, seq))
    labels = ids.clone()
    labels.view(-1)[torch.tensor(ignored, dtype=torch.long) % labels.numel()] = -100
    dtype = torch.bfloat16 if autocast else torch.float32
    monkeypatch.setattr(head, "CHUNK_BYTES", rows * _per_row(dtype))
    monkeypatch.setattr(head, "MIN_ROWS", 1)
    monkeypatch.setattr(head, "SMALLER_ONLY", False)  # the op's exactness, on heads of any size
    torch._dynamo.reset()  # each example a fresh model: no recompile limit across examples
    exact = copy.deepcopy(model).double()
    ref = _step(exact, exact, ids, labels, autocast=False)
    whole = _step(model, model, ids, labels, autocast=autocast)
    chunked_model = copy.deepcopy(model)
    if compiler == "rewrite_graph":  # a symbolic_trace graph under plain eager autograd
        fn = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(chunked_model), "none", example_inputs=(ids, labels))
        plans = [fn.plan]
    else:
        backend = ckpt_fx.backend(compiler=compiler)
        fn, plans = torch.compile(chunked_model, backend=backend), backend.plans
    chunked = _step(chunked_model, fn, ids, labels, autocast=autocast)
    (h,) = plans[0].heads
    assert h.chunk_rows == rows and h.chunks == -(-batch * (seq - 1) // rows)
    eps = 1e-6 if not autocast else 2e-3
    for name, e_chunked, e_whole, r in zip(["loss", *(n for n, _ in model.named_parameters())],
                                           _errors(chunked, ref), _errors(whole, ref), ref, strict=True):
        bound = 2 * e_whole + eps * max(r.abs().max().item(), 1e-30)
        if torch.isnan(r).any():  # every token ignored under "mean": 0 / 0, as the whole head gives
            continue
        assert e_chunked <= bound, (name, e_chunked, e_whole, bound)


@settings(max_examples=25)
@given(batch=st.integers(1, 4), seq=st.integers(2, 12), rows=st.integers(1, 20),
       ignored=st.lists(st.integers(0, 47), max_size=20), tied=st.booleans(), autocast=st.booleans(),
       upcast=st.booleans(), reduction=st.sampled_from(["mean", "sum"]))
def test_a_chunked_head_is_within_twice_the_whole_heads_error_against_float64(
        batch, seq, rows, ignored, tied, autocast, upcast, reduction, monkeypatch):
    """Note [The loss head in chunks]: chunking reorders the weight gradient's and the loss's sums,
    so the contract is a bound, not bitwise: for the loss and every gradient, the error against
    a float64 step is at most twice the whole head's error, plus 1e-6 (fp32) or 2e-3 (bf16
    autocast) of the value's magnitude; over shapes, chunk sizes, ignored tokens, tied weights,
    bf16 autocast, an upcast or none, sum and mean, under the eager inner compiler."""
    _check_bound(batch=batch, seq=seq, rows=rows, ignored=ignored, tied=tied, autocast=autocast, upcast=upcast,
                 reduction=reduction, compiler="eager", monkeypatch=monkeypatch)


def test_a_chunk_whose_every_token_is_ignored_adds_nothing(monkeypatch):
    """A chunk of ignored tokens (the padding at a sequence's end) contributes no loss and no
    gradient; the bound holds around it."""
    _check_bound(batch=2, seq=9, rows=4, ignored=list(range(8, 16)), tied=False, autocast=False, upcast=True,
                 reduction="mean", compiler="eager", monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True])
def test_the_bound_holds_under_inductor(autocast, monkeypatch):
    """The same bound with Inductor as the inner compiler (the op runs as an extern kernel)."""
    _check_bound(batch=3, seq=10, rows=5, ignored=[0, 1, 2, 17], tied=True, autocast=autocast, upcast=True,
                 reduction="mean", compiler="inductor", monkeypatch=monkeypatch)


@pytest.mark.parametrize("tied", [False, True])
def test_rewrite_graph_chunks_the_head_of_a_symbolic_trace_graph(tied, monkeypatch):
    """rewrite_graph finds the head in a torch.fx.symbolic_trace graph (the projection a call of
    an nn.Linear module there) and keeps the same bound, tied weights included."""
    _check_bound(batch=3, seq=7, rows=4, ignored=[0, 5, 6, 7], tied=tied, autocast=False, upcast=True,
                 reduction="mean", compiler="rewrite_graph", monkeypatch=monkeypatch)


def test_rewrite_graph_with_head_whole_or_an_unrecognised_head_keeps_it_as_written(monkeypatch):
    """head="whole" keeps the head bitwise; label smoothing is left whole with its reason; finding
    the shapes leaves a BatchNorm's counters as they were."""
    monkeypatch.setattr(head, "SMALLER_ONLY", False)
    torch.manual_seed(0)
    model = TinyLM(tied=False, upcast=True, reduction="mean")
    ids = torch.randint(0, VOCAB, (2, 6))
    whole = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(model), "none", example_inputs=(ids, ids), head="whole")
    assert whole.plan.heads == () and torch.equal(whole(ids, ids), model(ids, ids))
    smoothed = TinyLM(tied=False, upcast=True, reduction="mean", smoothing=0.1)
    kept = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(smoothed), "none", example_inputs=(ids, ids))
    assert kept.plan.heads == () and any("label smoothing" in r for r in kept.plan.head_reasons)
    with pytest.raises(ValueError, match="head"):
        ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(model), "none", example_inputs=(ids, ids), head="chunks")

    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lm = torch.nn.BatchNorm1d(WIDTH), TinyLM(tied=False, upcast=False, reduction="sum")

        def forward(self, ids, labels):
            h = self.norm(self.lm.embed(ids).flatten(0, 1))
            return F.cross_entropy(self.lm.head(h), labels.flatten(), reduction="sum")

    normed = Normed()
    out = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(normed), "none", example_inputs=(ids, ids))
    assert len(out.plan.heads) == 1 and int(normed.norm.num_batches_tracked) == 0


def test_dynamic_batch_is_served_by_one_chunked_graph(monkeypatch):
    """After a new batch size the dynamic graph keeps its chunked head, and stays exact."""
    monkeypatch.setattr(head, "CHUNK_BYTES", 3 * _per_row(torch.float32))
    monkeypatch.setattr(head, "MIN_ROWS", 1)
    monkeypatch.setattr(head, "SMALLER_ONLY", False)
    torch.manual_seed(0)
    model = TinyLM(tied=False, upcast=True, reduction="mean")
    backend = ckpt_fx.backend(compiler="eager")
    fn = torch.compile(model, backend=backend)
    for batch in (2, 3, 5):
        ids = torch.randint(0, VOCAB, (batch, 8))
        loss = fn(ids, ids)
        assert torch.allclose(loss, model(ids, ids), rtol=1e-5, atol=1e-6)
    # The first static graph, then one dynamic graph whose plan takes its place (Note [A recompile's plan]).
    assert len(backend.superseded) == 1 and len(backend.plans) == 1
    assert all(p.heads for p in backend.superseded + backend.plans)


def test_a_head_it_does_not_recognise_stays_whole_and_says_why():
    """Label smoothing needs every logit in the loss: the head is left as the model wrote it, the
    plan names why, and explain shows the line."""
    torch.manual_seed(0)
    model = TinyLM(tied=False, upcast=False, reduction="mean", smoothing=0.1)
    ids = torch.randint(0, VOCAB, (2, 8))
    backend = ckpt_fx.backend(compiler="eager")
    torch.compile(model, backend=backend)(ids, ids).backward()
    (plan,) = backend.plans
    assert plan.heads == () and any("label smoothing" in r for r in plan.head_reasons)
    report = ckpt_fx.explain(model, ids, ids, compiler="eager")
    assert "loss head left whole" in str(report) and "label smoothing" in str(report)


def test_head_whole_keeps_the_graph_as_it_was():
    """head="whole" plans the head as written: gradients bitwise those of aot_eager."""
    torch.manual_seed(0)
    model = TinyLM(tied=False, upcast=True, reduction="mean")
    ids = torch.randint(0, VOCAB, (2, 8))
    base_model = copy.deepcopy(model)
    base = _step(base_model, torch.compile(base_model, backend="aot_eager"), ids, ids, autocast=False)
    m = copy.deepcopy(model)
    backend = ckpt_fx.backend(compiler="eager", head="whole")
    got = _step(m, torch.compile(m, backend=backend), ids, ids, autocast=False)
    assert backend.plans[0].heads == ()
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))


def test_bad_head_and_logits_options_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"head must be one of 'chunked', 'whole', got 'halved'"):
        ckpt_fx.backend(head="halved")
    with pytest.raises(ValueError, match=r"logits must be one of 'keep', 'drop', got 'no'"):
        ckpt_fx.backend(logits="no")


def test_the_plan_and_explain_show_a_head_row_and_the_prediction_counts_its_chunk(monkeypatch):
    """The built-in LLaMA-style model: its head is chunked, explain prints the head's row, and the
    predicted step peak is within 10% of the measured one."""
    _small_chunks(monkeypatch, 64)
    torch.manual_seed(0)
    model = build("llama", layers=2, dim=32, heads=2, vocab=2000).train()
    ids = torch.randint(0, 2000, (4, 64))
    report = ckpt_fx.explain(model, ids, ids, compiler="eager", measure=True)
    text = str(report)
    assert "loss head: 256 tokens x 2000 vocabulary in 4 chunks of 64 rows" in text
    assert abs(report.predicted_peak_bytes - report.measured_peak_bytes) <= 0.10 * report.measured_peak_bytes


def _small_chunks(monkeypatch, rows: int) -> None:
    """Chunks of `rows` rows, so that a small test model's head is chunked at all."""
    monkeypatch.setattr(head, "MIN_ROWS", rows)
    monkeypatch.setattr(head, "CHUNK_BYTES", 0)


def test_a_head_whose_tokens_fit_one_chunk_stays_whole_and_says_why():
    """Only where chunks keep less: 32 tokens in one chunk of the default size would keep the
    gradients and every row's temporaries, more than the whole head; it is left whole, with why."""
    model = _hf_llama()
    ids = torch.randint(0, 4000, (2, 16))
    backend = ckpt_fx.backend(compiler="eager")
    out = torch.compile(model, backend=backend)(input_ids=ids, labels=ids)
    out.loss.backward()
    assert backend.plans[0].heads == ()
    assert any("no fewer than" in r and "(32 tokens)" in r for r in backend.plans[0].head_reasons), \
        backend.plans[0].head_reasons


def test_under_enable_a_head_one_chunk_would_cover_runs_beside_the_compiled_backbone():
    """Whole, such a head keeps less run eagerly than run as Python in the model's graph (its logits
    returned and saved together): under the eager inner compiler enable compiles only the backbone
    for those calls, whose peak is then that of head="whole"; larger calls compile the whole model
    with the head in chunks."""
    ids = torch.randint(0, 4000, (2, 16))

    def step(head_option):
        model = _hf_llama()
        backend = ckpt_fx.enable(model, compiler="eager", head=head_option)

        def run():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        run()
        return backend, ckpt_fx.peak_bytes(run)

    backend, peak = step("chunked")
    (plan,) = backend.plans
    assert plan.heads == () and not any(p.startswith("lm_head") for p in plan.module_paths)
    assert plan.blocks[0].path == "layers.0"  # the backbone's graph names its units from the backbone
    assert peak == step("whole")[1]
    assert head.keeps_less_in_chunks(tokens=4096, vocab=4000, hidden=32, dtype=torch.float32, weight_grad=True)
    assert not head.keeps_less_in_chunks(tokens=32, vocab=4000, hidden=32, dtype=torch.float32, weight_grad=True)
    assert not head.keeps_less_in_chunks(tokens=4096, vocab=100, hidden=32, dtype=torch.float32, weight_grad=True)


def _hf_llama(vocab=4000):
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=vocab)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def test_enable_chunks_a_causal_lms_head_and_drops_its_logits_only_in_training_calls_with_labels(monkeypatch):
    """Note [The loss head under enable], Note [Logits in training calls]: a training call with
    labels returns the loss (equal to the model's own) and logits=None, with a chunked head in its
    plan; without labels, or in eval, the logits are there; disable restores both forwards."""
    _small_chunks(monkeypatch, 8)
    model = _hf_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 4000, (2, 16))
    backend = ckpt_fx.enable(model, compiler="eager")
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    assert torch.allclose(out.loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-5)
    out.loss.backward()
    assert [len(p.heads) for p in backend.plans] == [1]
    assert model(input_ids=ids).logits.shape == (2, 16, 4000)
    model.eval()
    assert model(input_ids=ids, labels=ids).logits is not None
    model.train()
    kept = ckpt_fx.enable(model, compiler="eager", logits="keep")
    assert model(input_ids=ids, labels=ids).logits.shape == (2, 16, 4000)
    assert kept.plans[0].heads[0].logits_kept
    ckpt_fx.disable(model)
    assert "forward" not in model.__dict__ and "forward" not in model.model.__dict__


def test_enable_with_head_whole_leaves_the_head_outside_as_before():
    model = _hf_llama()
    ids = torch.randint(0, 4000, (2, 16))
    backend = ckpt_fx.enable(model, compiler="eager", head="whole")
    out = model(input_ids=ids, labels=ids)
    assert out.logits is not None and all(not p.heads for p in backend.plans)
    assert "forward" not in model.__dict__
    with pytest.raises(ValueError, match="logits must be one of"):
        ckpt_fx.enable(model, logits="none")


def test_a_chunked_head_lowers_the_measured_step_peak_under_enable(monkeypatch):
    """Memory measured, not inferred: a causal LM whose vocabulary is 250x its width, HF's own
    checkpointing against enable with the head in chunks of 64 rows (eager inner compiler)."""
    _small_chunks(monkeypatch, 64)

    model = _hf_llama(vocab=8000)
    ids = torch.randint(0, 8000, (4, 128))
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt_fx.enable(model, compiler="eager")

    def peak(m):
        step = lambda: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # noqa: E731
        step()
        for p in m.parameters():
            p.grad = None
        return ckpt_fx.peak_bytes(step)

    ours, theirs = peak(model), peak(hf)
    assert ours <= 0.5 * theirs, (ours, theirs)


def test_the_head_bench_prints_each_setup_with_measured_ratios(capsys, monkeypatch):
    """python -m ckpt_fx.bench.head on a small Llama: a row per setup, the chunked head's measured
    peak below the whole head's."""
    from ckpt_fx.bench import head as bench_head

    _small_chunks(monkeypatch, 32)
    bench_head.main(["--layers", "2", "--dim", "32", "--vocab", "4000", "--batch", "2", "--seq", "128", "--rounds", "1"])
    rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| HF") or line.startswith("| ckpt-fx")}
    assert {"HF checkpointing", "ckpt-fx, head whole", "ckpt-fx, head chunked"} <= set(rows)
    assert float(rows["ckpt-fx, head chunked"][2]) < float(rows["ckpt-fx, head whole"][2])


def test_the_main_bench_runs_the_head_table_on_the_model_it_names_and_refuses_what_it_cannot(capsys, monkeypatch):
    """python -m ckpt_fx bench --head: the same rows on a causal LM named by the bench's --model;
    a model that is no transformers causal LM, or a flag the head table does not take, is refused
    in one line (exit 2)."""
    from ckpt_fx.__main__ import main

    _small_chunks(monkeypatch, 32)
    assert main(["bench", "--head", "--model", "hf:Qwen3Config", "--layers", "2", "--dim", "32", "--config",
                 "vocab_size=4000", "--batch", "2", "--seq", "128", "--steps", "1", "--compiler", "eager"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM 2x32" in out and "inner compiler eager" in out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    assert float(rows["ckpt-fx, head chunked"][2]) < float(rows["ckpt-fx, head whole"][2])
    for argv, said in ((["--head", "--model", "llama", "--layers", "2"], "needs a transformers causal LM"),
                       (["--head", "--sweep", "0.5"], "drop --sweep"),
                       (["--compiler", "eager"], "--compiler applies to --head")):
        assert main(["bench", *argv]) == 2
        assert said in capsys.readouterr().err


def test_gpt2s_tied_head_is_chunked_under_enable_despite_its_loss_logging(monkeypatch):
    """transformers' GPT-2 logs from its loss function on every call; enable traces that call as a
    no-op, so the tied head (its weight the token embedding's) is found and chunked, and the loss
    and gradients match the model's own (fp32, dropout off)."""
    import transformers

    _small_chunks(monkeypatch, 16)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=4000, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 4000, (2, 32))
    backend = ckpt_fx.enable(model, compiler="eager")
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    assert len(backend.plans) == 1 and len(backend.plans[0].heads) == 1
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.allclose(out.loss, expected.loss, rtol=1e-5)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, r.grad, rtol=1e-4, atol=1e-6)


def test_a_lora_models_frozen_head_is_chunked_with_hfs_switch_on(monkeypatch):
    """peft LoRA on every linear layer, HF's checkpointing switched on first (peft's input-grad hook
    on the embedding breaks dynamo's graph there): the blocks' graph still reports the units the
    model's switch covered, the frozen head is chunked without a weight gradient, and the loss and
    gradients match the model's own."""
    peft = pytest.importorskip("peft")
    _small_chunks(monkeypatch, 32)
    torch.manual_seed(0)
    model = peft.get_peft_model(_hf_llama(vocab=8000), peft.LoraConfig(r=8, target_modules="all-linear")).train()
    reference = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    backend = ckpt_fx.enable(model, compiler="eager")
    ids = torch.randint(0, 8000, (2, 64))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    heads = [h for p in backend.plans for h in p.heads]
    assert len(heads) == 1 and not heads[0].weight_grad and out.logits is None
    assert any(p.checkpointed_by_model == ("layers.0", "layers.1") for p in backend.plans)
    assert torch.allclose(out.loss, expected.loss, rtol=1e-5)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (r.grad is None)
        assert p.grad is None or torch.allclose(p.grad, r.grad, rtol=1e-4, atol=1e-6)
