"""Workloads for the bench, explain, solvers and fit commands: a model and one batch, built by
name (transformers' GPT-2, a built-in model, any transformers causal-LM config class) or by a
user's `module:function` factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_fx.report import training_loss
from passes._compat import pytree


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model and one batch."""

    name: str
    model: torch.nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def loss(self, fn: Callable[..., Any]) -> torch.Tensor:
        """Run a forward through fn (the model, compiled or not) and return the scalar loss."""
        return training_loss(fn(*self.args, **self.kwargs))

    def to(self, device: str | torch.device) -> Workload:
        """The same workload with its model and every tensor argument on `device`."""
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda': torch sees no CUDA device here; valid: cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {str(device)!r}: valid: cpu, cuda")
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return Workload(name=self.name, model=self.model.to(device), args=pytree.tree_map(move, self.args),
                        kwargs=pytree.tree_map(move, self.kwargs))


def gpt2_workload(*, layers: int = 12, dim: int = 256, heads: int = 4, vocab: int = 1000, batch: int = 8, seq: int = 256,
                  attention: str = "sdpa") -> Workload:
    """transformers' GPT2LMHeadModel from a small config (random weights, `attention` its
    attn_implementation: transformers' default, SDPA, unless "eager" is asked for; its default
    dropout, train mode), fed random token ids as input and labels."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=seq,
                     bos_token_id=0, eos_token_id=0, attn_implementation=attention)
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return Workload(
        name=f"GPT-2 {layers}x{dim}, batch {batch}x{seq}",
        model=model,
        kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
    )


def builtin_workload(name: str = "llama", *, batch: int = 8, seq: int = 256, **config: object) -> Workload:
    """A built-in model (ckpt_fx.models) fed random token ids as input and labels."""
    from ckpt_fx.bench.models import build

    torch.manual_seed(0)
    model = build(name, **config).train()
    vocab = model.head.out_features
    ids = torch.randint(0, vocab, (batch, seq))
    return Workload(name=f"built-in {name} {config}, batch {batch}x{seq}", model=model, args=(ids, ids))


MODEL_FORMS = (
    "gpt2 (transformers' GPT2LMHeadModel), llama or gpt (built-in), hf:<ConfigClass> (any transformers "
    "causal-LM config, e.g. hf:LlamaConfig), or <module>:<function> (a factory returning a Workload, "
    "(model, args) or (model, args, kwargs))"
)


def hf_workload(config_class: str, *, layers: int = 12, dim: int = 256, heads: int = 4, vocab: int = 1000,
                batch: int = 8, seq: int = 256, overrides: dict[str, Any] | None = None) -> Workload:
    """A transformers causal LM built from a config class by name (random weights, train mode):
    layers, width and heads set through the config's standard names (num_hidden_layers,
    hidden_size, num_attention_heads), a 4x MLP where the config has intermediate_size, half as
    many key/value heads (grouped-query attention) where it has num_key_value_heads, transformers'
    default attention (SDPA), then `overrides` (any config attribute) on top. Fed random token ids
    as input and labels."""
    import transformers

    cls = getattr(transformers, config_class, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        raise ValueError(f"model 'hf:{config_class}': transformers has no config class {config_class!r} "
                         "(e.g. hf:LlamaConfig, hf:GPT2Config, hf:MistralConfig)")
    torch.manual_seed(0)
    config = cls()
    settings: dict[str, Any] = {"num_hidden_layers": layers, "hidden_size": dim, "num_attention_heads": heads,
                                "vocab_size": vocab}
    if hasattr(config, "intermediate_size"):
        settings["intermediate_size"] = 4 * dim
    if hasattr(config, "num_key_value_heads"):  # grouped-query attention, as the models people train use
        settings["num_key_value_heads"] = heads // 2 if heads % 2 == 0 else heads
    if getattr(config, "max_position_embeddings", seq) < seq:
        settings["max_position_embeddings"] = seq
    settings.update(overrides or {})
    attention = settings.pop("attn_implementation", None)  # not a config attribute: from_config takes it
    for key, value in settings.items():
        if key in (overrides or {}) and not hasattr(config, key):
            raise ValueError(f"model 'hf:{config_class}': the config has no attribute {key!r}")
        setattr(config, key, value)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, key, None) is not None and getattr(config, key) >= config.vocab_size:
            setattr(config, key, 0)
    try:
        extra = {"attn_implementation": attention} if attention is not None else {}
        model = transformers.AutoModelForCausalLM.from_config(config, **extra).train()
    except ValueError as error:
        raise ValueError(f"model 'hf:{config_class}': not a causal LM transformers can build: {error}") from None
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    shown = ", ".join(f"{k}={v}" for k, v in (overrides or {}).items())
    return Workload(
        name=f"{type(model).__name__} {layers}x{dim}{f' ({shown})' if shown else ''}, batch {batch}x{seq}",
        model=model,
        kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
    )


def factory_workload(spec: str) -> Workload:
    """The workload a `module:function` factory returns: a Workload, (model, args) or
    (model, args, kwargs); the model is put in train mode."""
    import pkgutil

    module_name, _, function_name = spec.partition(":")
    try:
        factory = pkgutil.resolve_name(spec)
    except ImportError as error:
        raise ValueError(f"model {spec!r}: cannot import module {module_name!r} ({error})") from None
    except AttributeError:
        raise ValueError(f"model {spec!r}: module {module_name!r} has no function {function_name!r}") from None
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {type(factory).__name__} is not a function")
    torch.manual_seed(0)
    made = factory()
    if isinstance(made, Workload):
        made.model.train()
        return made
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], torch.nn.Module):
        model, args, kwargs = (*made, {}) if len(made) == 2 else made
        args = args if isinstance(args, tuple) else (args,)
        return Workload(name=f"{spec} ({type(model).__name__})", model=model.train(), args=args, kwargs=dict(kwargs))
    raise ValueError(f"model {spec!r}: the factory returned {type(made).__name__}; "
                     "expected a Workload, (model, args) or (model, args, kwargs)")


def workload(model: str, *, layers: int = 12, dim: int = 256, heads: int = 4, batch: int = 8, seq: int = 256,
             overrides: dict[str, Any] | None = None) -> Workload:
    """A workload by name (MODEL_FORMS); `overrides` set config attributes (built-in and hf: models)."""
    if model == "gpt2" and not overrides:
        return gpt2_workload(layers=layers, dim=dim, heads=heads, batch=batch, seq=seq)
    if model == "gpt2":
        return hf_workload("GPT2Config", layers=layers, dim=dim, heads=heads, batch=batch, seq=seq, overrides=overrides)
    if model in ("llama", "gpt"):
        from ckpt_fx.bench.models import ModelConfig

        valid = set(ModelConfig.__dataclass_fields__) - {"layers", "dim", "heads"}
        unknown = sorted(set(overrides or {}) - valid)
        if unknown:
            raise ValueError(f"model {model!r}: unknown config key(s) {unknown}; valid: {', '.join(sorted(valid))}")
        return builtin_workload(model, layers=layers, dim=dim, heads=heads, batch=batch, seq=seq, **(overrides or {}))
    prefix, sep, rest = model.partition(":")
    if sep and prefix == "hf":
        return hf_workload(rest, layers=layers, dim=dim, heads=heads, batch=batch, seq=seq, overrides=overrides)
    if sep and prefix and rest:
        if overrides:
            raise ValueError(f"model {model!r}: --config applies to built-in and hf: models, not to a factory")
        return factory_workload(model)
    raise ValueError(f"unknown model {model!r}; valid: {MODEL_FORMS}")


def parse_overrides(text: str | None) -> dict[str, Any]:
    """'key=value,key=value' to a dict; values are Python literals where they parse (4, 0.1, True,
    'silu'), else strings."""
    import ast

    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"--config: expected key=value, got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out
