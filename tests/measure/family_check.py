"""Model families with nested stages, BatchNorm and shared layers: measured peak of one training
step over eager's, for the default policy, blocks:every=1,skip_first=0 and HF's per-block
checkpointing, with the largest gradient difference from eager and whether the buffers (BatchNorm's
running statistics) equal eager's after the same two steps (eager inner compiler).

    python tests/measure/family_check.py [swin] [convnext] [resnet] [albert]     (about 2 minutes on 2 cores)
"""
import copy
import sys

import torch
import transformers

from ckpt_fx.measure import peak_bytes
from ckpt_fx.bench.setups import hf_checkpointing_enable

def swin():
    cfg = transformers.SwinConfig(image_size=224, patch_size=4, embed_dim=32, depths=[2, 2, 6, 2], num_heads=[1, 2, 4, 8], window_size=7, num_labels=10)
    return transformers.SwinForImageClassification(cfg), "img"
def convnext():
    cfg = transformers.ConvNextConfig(hidden_sizes=[24, 48, 96, 192], depths=[2, 2, 6, 2], num_labels=10)
    return transformers.ConvNextForImageClassification(cfg), "img"
def resnet():
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[64, 128, 256, 512], depths=[3, 4, 6, 3], layer_type="bottleneck", num_labels=10)
    return transformers.ResNetForImageClassification(cfg), "img"
def albert():
    cfg = transformers.AlbertConfig(vocab_size=1000, embedding_size=64, hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512, max_position_embeddings=256)
    return transformers.AlbertForMaskedLM(cfg), "tok"
BUILD = dict(swin=swin, convnext=convnext, resnet=resnet, albert=albert)

def batch(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "img":
        return dict(pixel_values=torch.randn(4, 3, 224, 224, generator=g), labels=torch.randint(0, 10, (4,), generator=g))
    ids = torch.randint(0, 1000, (4, 128), generator=g)
    return dict(input_ids=ids, labels=ids)

def step_peak(model, inputs):
    def step():
        loss = model(**inputs).loss
        loss.backward()
    step()  # compile / warm
    for p in model.parameters(): p.grad = None
    peak = peak_bytes(step)
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters(): p.grad = None
    buffers = {n.removeprefix("_orig_mod."): b.clone() for n, b in model.named_buffers()}
    return peak, grads, buffers

def main():
    names = sys.argv[1:] or list(BUILD)
    for name in names:
        torch.manual_seed(0)
        base, kind = BUILD[name]()
        base.train()
        inputs = batch(kind)
        rows = {}
        m = copy.deepcopy(base); torch.manual_seed(5); rows["eager"] = step_peak(m, inputs)
        for label, pol in [("default", None), ("skip0", "blocks:every=1,skip_first=0")]:
            m = copy.deepcopy(base); torch._dynamo.reset()
            opts = {"compiler": "eager"} if pol is None else {"policy": pol, "compiler": "eager"}
            c = torch.compile(m, backend="ckpt", options=opts)
            torch.manual_seed(5); rows[label] = step_peak(c, inputs)
        if getattr(base, "supports_gradient_checkpointing", False):
            m = copy.deepcopy(base); hf_checkpointing_enable(m, use_reentrant=False)
            torch.manual_seed(5); rows["hf"] = step_peak(m, inputs)
        e = rows["eager"][0]
        out = []
        for k, (p, g, b) in rows.items():
            diff = max(((g[n] - rows["eager"][1][n]).abs().max().item() for n in g), default=0.0)
            same = all(torch.equal(b[n], rows["eager"][2][n]) for n in b) and b.keys() == rows["eager"][2].keys()
            out.append(f"{k}={p/2**20:.1f}MB({p/e:.3f}x, dgrad={diff:.1e}, buffers {'equal' if same else 'DIFFER'})")
        print(name, " ".join(out), flush=True)

if __name__ == '__main__':
    main()
