"""Workloads for the bench, explain, solvers and fit commands: a model and one batch, built by
name (transformers' GPT-2, a built-in model, any transformers causal-LM config class) or by a
user's `module:function` factory."""

from __future__ import annotations

import inspect
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
    """A built-in model (ckpt_fx.bench.models) fed random token ids as input and labels."""
    from ckpt_fx.bench.models import build

    torch.manual_seed(0)
    model = build(name, **config).train()
    vocab = model.head.out_features
    ids = torch.randint(0, vocab, (batch, seq))
    return Workload(name=f"built-in {name} {config}, batch {batch}x{seq}", model=model, args=(ids, ids))


MODEL_FORMS = (
    "a config.json (a file, a directory holding one, or a hub name such as meta-llama/Meta-Llama-3-8B), "
    "gpt2 (transformers' GPT2LMHeadModel), llama or gpt (built-in), hf:<ConfigClass> (any transformers "
    "causal-LM config, e.g. hf:LlamaConfig), or <module>:<function> (a factory returning a Workload, "
    "(model, args) or (model, args, kwargs))"
)


LANGUAGE_MODEL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM")
"""The model classes a config's `architectures` may name that train on token labels."""


def names_a_config(model: str) -> bool:
    """`model` names a transformers config: a .json file, a directory, or a hub name (owner/name)."""
    import os

    return model.endswith(".json") or os.path.isdir(model) or ("/" in model and ":" not in model)


def config_workload(source: str, *, batch: int = 8, seq: int = 256, layers: int | None = None, dim: int | None = None,
                    heads: int | None = None, overrides: dict[str, Any] | None = None) -> Workload:
    """The model a transformers config describes (random weights, train mode), read by
    transformers' AutoConfig from a config.json file, a directory holding one, or a hub name (the
    hub is asked only when no such file or directory exists). `layers`, `dim`, `heads` (when
    given) and `overrides` are set on the config; built as the language model its `architectures`
    names (as a hub config.json does), else as a causal LM where transformers can, else as a
    seq2seq LM, else as a masked LM. Fed random token ids as input and labels."""
    import os

    import transformers

    where = f"model {source!r}"
    if source.endswith(".json") and not os.path.isfile(source):
        raise ValueError(f"{where}: no such file")
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
        raise ValueError(f"{where}: the directory holds no config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError) as error:
        local = os.path.exists(source)
        why = "transformers cannot read it as a model config" if local else (
            "not a local file or directory, and no config came from the hub under that name (offline?)")
        raise ValueError(f"{where}: {why}: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    sizes = {"num_hidden_layers": layers, "hidden_size": dim, "num_attention_heads": heads}
    width, count = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    derived = isinstance(width, int) and isinstance(count, int) and count > 0 and getattr(config, "head_dim", None) == width // count
    if (dim or heads) and derived and "head_dim" not in (overrides or {}):  # a head's width follows, as in the file
        sizes["head_dim"] = (dim or width) // (heads or count)
    for key, value in [*((k, v) for k, v in sizes.items() if v is not None), *(overrides or {}).items()]:
        if key != "attn_implementation" and not hasattr(config, key):
            raise ValueError(f"{where}: the config ({type(config).__name__}) has no attribute {key!r}")
        setattr(config, key, value)
    longest = getattr(config, "max_position_embeddings", None)
    if isinstance(longest, int) and longest < seq:
        raise ValueError(f"{where}: --seq {seq} is longer than the config's max_position_embeddings ({longest})")
    torch.manual_seed(0)
    model = None
    named = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or ()
             if a.endswith(LANGUAGE_MODEL_HEADS)]
    for kind in (*filter(None, named), transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM,
                 transformers.AutoModelForMaskedLM):
        try:
            model = (kind.from_config(config) if kind.__name__.startswith("Auto") else kind(config)).train()
            break
        except ValueError:  # transformers: this config has no model of that kind
            continue
    if model is None:
        raise ValueError(f"{where}: transformers builds no causal, seq2seq or masked LM from a "
                         f"{type(config).__name__}")
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    kwargs: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    blocks = getattr(config, "num_hidden_layers", "?")
    return Workload(name=f"{type(model).__name__} from {source} ({blocks} layers), batch {batch}x{seq}",
                    model=model, kwargs=kwargs)


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
    defaults = cls()
    settings: dict[str, Any] = {"num_hidden_layers": layers, "hidden_size": dim, "num_attention_heads": heads,
                                "vocab_size": vocab}
    if hasattr(defaults, "intermediate_size"):
        settings["intermediate_size"] = 4 * dim
    if hasattr(defaults, "num_key_value_heads"):  # grouped-query attention, as the models people train use
        settings["num_key_value_heads"] = heads // 2 if heads % 2 == 0 else heads
    if getattr(defaults, "max_position_embeddings", seq) < seq:
        settings["max_position_embeddings"] = seq
    for key in (overrides or {}):
        if key != "attn_implementation" and not hasattr(defaults, key):
            raise ValueError(f"model 'hf:{config_class}': the config has no attribute {key!r}")
    settings.update(overrides or {})
    attention = settings.pop("attn_implementation", None)  # not a config attribute: from_config takes it
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key not in settings and getattr(defaults, key, None) is not None and getattr(defaults, key) >= settings["vocab_size"]:
            settings[key] = 0
    # Given to the constructor, not set afterwards: a config derives some fields from others there
    # (Llama's head_dim from the width and heads), which a later setattr would leave at the default
    # model's.
    config = cls(**settings)
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


def workload(model: str, *, layers: int | None = None, dim: int | None = None, heads: int | None = None,
             batch: int = 8, seq: int = 256, overrides: dict[str, Any] | None = None,
             default_layers: int = 12) -> Workload:
    """A workload by name (MODEL_FORMS); `overrides` set config attributes (config files, built-in
    and hf: models). A config file keeps its own layers, width and heads where they are not given;
    the other forms take `default_layers`, 256 and 4."""
    if names_a_config(model):
        return config_workload(model, batch=batch, seq=seq, layers=layers, dim=dim, heads=heads, overrides=overrides)
    layers, dim, heads = layers or default_layers, dim or 256, heads or 4
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
