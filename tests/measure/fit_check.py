"""fit()'s predicted training-step peak against the measured peak of the same step on this CPU:
forward, backward and AdamW's step, the second step of a run (optimizer state allocated), for
models, precisions, trainable subsets and policies side by side.

    python tests/measure/fit_check.py          (about 15 minutes on 2 cores)
"""
from __future__ import annotations

import contextlib
import copy

import torch

from ckpt_fx.report import training_loss
from ckpt_fx.fit import fit
from ckpt_fx.measure import peak_bytes

POLICIES = ("none", "blocks", "blocks:every=1,skip_first=0")


def measured_step_peak(model: torch.nn.Module, args: tuple, kwargs: dict, *, policy: str, precision: str) -> int:
    """Bytes live at the peak of a real training step: what exists before it (weights, buffers,
    AdamW's state) plus the peak the step allocates above that (ckpt_fx.measure). The model's
    outputs are held until the backward ends, and a chunked head's logits are not returned, as
    fit() assumes (as enable runs a training call with labels)."""
    model = copy.deepcopy(model).train()
    compiled = torch.compile(model, backend="ckpt", options={"policy": policy, "compiler": "eager", "logits": "drop"})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()

    def step() -> None:  # outputs held through the backward, as in `outputs = model(**batch); outputs.loss.backward()`
        with cast:
            outputs = compiled(*args, **kwargs)
        training_loss(outputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # compiles, and allocates the optimizer's state
    before = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in [*model.parameters(), *model.buffers(),
                        *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]}
    return sum(before.values()) + peak_bytes(step)


def llama():
    from ckpt_fx.bench.models import build

    torch.manual_seed(0)
    model = build("llama", layers=4, dim=256)
    ids = torch.randint(0, model.head.out_features, (4, 128))
    return model, (ids, ids), {}


def hf(config_class: str, **config):
    import transformers

    def make():
        torch.manual_seed(0)
        cfg = getattr(transformers, config_class)(**config)
        if config_class == "BertConfig":
            return transformers.BertForMaskedLM(cfg)
        return transformers.AutoModelForCausalLM.from_config(cfg)

    model = make()
    ids = torch.randint(0, config["vocab_size"], (4, 128))
    kwargs = {"input_ids": ids, "labels": ids}
    if config_class != "BertConfig":
        kwargs["use_cache"] = False
    return model, (), kwargs


MODELS = {
    "built-in llama 4x256": llama,
    "GPT-2 4x256": lambda: hf("GPT2Config", n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=128,
                              bos_token_id=0, eos_token_id=0,
                              attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "Qwen2 4x256": lambda: hf("Qwen2Config", num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=704, vocab_size=1000),
    "BERT 4x256": lambda: hf("BertConfig", num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                             intermediate_size=1024, vocab_size=1000, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0),
}


def lora(model: torch.nn.Module) -> torch.nn.Module:
    """The model with peft's LoRA adapters (r=8) on its attention projections; the base frozen."""
    import peft

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
    targets = sorted(names & {"q_proj", "v_proj", "query", "value", "wq", "wv", "qkv", "c_attn"})
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets, lora_dropout=0.0))


def check(name: str, *, precision: str, adapters: bool) -> list[tuple[str, int, int]]:
    """[(policy, predicted, measured)] for one model, precision and trainable subset."""
    model, args, kwargs = MODELS[name]()
    if adapters:
        model = lora(model)
    report = fit(model, *args, memory="64GiB", policies=POLICIES, precision=precision, device="cpu", **kwargs)
    rows = []
    for row, policy in zip(report.rows, POLICIES):
        torch._dynamo.reset()
        rows.append((row.policy, row.peak_bytes, measured_step_peak(model, args, kwargs, policy=policy, precision=precision)))
    return rows


def main() -> None:
    print("| model | precision | trained | policy | predicted MB | measured MB | predicted / measured |")
    print("|---|---|---|---|---:|---:|---:|")
    for name in MODELS:
        for precision in ("fp32", "bf16-mixed"):
            for adapters in (False, True):
                for policy, predicted, measured in check(name, precision=precision, adapters=adapters):
                    print(f"| {name} | {precision} | {'LoRA r=8' if adapters else 'all'} | {policy} | "
                          f"{predicted / 2**20:.1f} | {measured / 2**20:.1f} | {predicted / measured:.3f} |", flush=True)


if __name__ == "__main__":
    main()
