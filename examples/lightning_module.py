"""Lightning with ckpt-fx: a LightningModule whose inner model is switched on in place; train,
write a checkpoint, load it back.

    python examples/lightning_module.py

Enable ckpt-fx on the model inside the LightningModule (`ckpt_fx.enable(self.net)`), not on the
LightningModule with `torch.compile(...)`: compiling the LightningModule itself fails inside torch
and Lightning (with aot_eager too), and a `torch.compile` wrapper would store its weights under
`_orig_mod.*`. Enabled in place, the checkpoint's keys are the module's own.
"""

import tempfile

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import ckpt_fx

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


class LanguageModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = LlamaForCausalLM(CONFIG)
        self.backend = ckpt_fx.enable(self.net)  # in place: training steps checkpointed

    def training_step(self, batch, batch_idx):
        loss = self.net(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
module = LanguageModel()
data = DataLoader(list(torch.randint(0, 256, (16, 64))), batch_size=4)
with tempfile.TemporaryDirectory() as out:
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    trainer.fit(module, data)
    plan = module.backend.plans[0]
    print(f"trained {trainer.global_step} steps; plan {plan.policy}: {len(plan.recomputed)} ops recomputed")
    trainer.save_checkpoint(f"{out}/last.ckpt")
    keys = set(torch.load(f"{out}/last.ckpt", weights_only=False)["state_dict"])
    print("checkpoint keys are the module's own:", keys == set(module.state_dict()))
    reloaded = LanguageModel.load_from_checkpoint(f"{out}/last.ckpt")
    same = all(torch.equal(v, module.state_dict()[k]) for k, v in reloaded.state_dict().items())
    print("reloaded weights equal the trained ones:", same)
    if not same or keys != set(module.state_dict()):
        raise SystemExit("the checkpoint does not hold the trained weights under the module's own keys")
