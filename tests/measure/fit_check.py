"""fit()'s predicted training-step peak against the measured peak of the same step on this CPU:
forward, backward and AdamW's step, the second step of a run (optimizer state allocated), for
models, precisions, trainable subsets and policies side by side.

    python tests/measure/fit_check.py          (about 15 minutes on 2 cores)
"""
from __future__ import annotations

import pathlib
import sys

import torch

from ckpt_fx.fit import fit, measured_step_peak

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run by path: the repository, for tests._models
from tests._models import lora  # noqa: E402

POLICIES = ("none", "blocks", "blocks:every=1,skip_first=0")


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
