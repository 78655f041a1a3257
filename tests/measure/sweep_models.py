"""Factories for `python -m ckpt_fx bench --model tests.measure.sweep_models:<name>`: the encoder and the
vision model of the README's sweep across families (small random configs, dropout off, the
models' default attention)."""
import torch
import transformers


def bert():
    """A BERT masked LM: 4 layers of 256, batch 4 x 256."""
    config = transformers.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024, max_position_embeddings=256,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 1000, (4, 256), generator=torch.Generator().manual_seed(1))
    return transformers.BertForMaskedLM(config), (), dict(input_ids=ids, labels=ids)


def vit():
    """A ViT classifier: 4 layers of 256 on 224 x 224 images in 16 x 16 patches, batch 8."""
    config = transformers.ViTConfig(image_size=224, patch_size=16, hidden_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, intermediate_size=1024, num_labels=10,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                    problem_type="single_label_classification")  # else the loss sets it: a recompile
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(8, 3, 224, 224, generator=generator)
    labels = torch.randint(0, 10, (8,), generator=generator)
    return transformers.ViTForImageClassification(config), (), dict(pixel_values=images, labels=labels)
