"""enable / disable: checkpointing switched on in place, as transformers' own switch is. The model
keeps its class, its state-dict keys, and, where no gradients are recorded (eval, no_grad,
generate), its own uncompiled forward.

Note [The module enable switches]
Trainers call a model in more than one way: Hugging Face's Trainer calls its forward, TRL's
SFTTrainer replaces that forward with its own (a fused LM head) that calls the backbone holding the
blocks directly, Lightning calls whatever the LightningModule does. Every way runs the backbone,
so the switch sits there: on the smallest module holding every stack of repeated blocks (the
decoder model under a causal-LM head, the encoder and decoder's common parent), or the model itself
when it has no such stack. What lies outside it (an LM head, a loss) runs eagerly: checkpointing
recomputes nothing there anyway.

Note [The model's own checkpointing under enable]
A Hugging Face model's own switch (`activation_checkpointing_enable`, which TRL and Trainer turn on)
sets a `gradient_checkpointing` flag on its layers, and each flagged layer then runs its forward
inside torch.utils.checkpoint. ckpt-fx's plan replaces that checkpointing, so for each compiled call
enable turns the flags off, passes `use_cache=False` as the switch would (a training step keeps no
KV cache), and turns them back on when the call returns: the graph traced is the model's plain
forward, not the checkpoint wrappers, whose details change between releases (in transformers 5.25
a logging call and a state change inside them break dynamo's graph at every layer, and nothing
would be planned). The backend is told which units the switch would have checkpointed
(`CkptBackend.checkpointed_by_model`), so each plan still reports them and says when it
recomputes fewer. Eval, no_grad and generate run the model as it is, flags included.

Note [The loss head under enable]
A causal LM's head (its projection to the vocabulary and its cross-entropy) keeps more than every
checkpointed block together on today's vocabularies, and it lies outside the backbone. So where
the backbone's parent has output embeddings (a Hugging Face causal LM: `get_output_embeddings()`),
enable switches that module too: a training call that passes labels (Trainer's, Lightning's that
read `.loss`) runs its whole forward compiled, backbone and head in one graph, and the backend
chunks the head (Note [The loss head in chunks] in passes/head.py). With head="whole", and under
the eager inner compiler for a call whose head the backend would leave whole (one chunk would
cover its tokens: SMALLER_ONLY), the head runs eagerly beside the compiled backbone, as the model
wrote it: run as Python in the graph, a whole head keeps its logits twice over. Inductor fuses a
whole head's log-softmax into its loss, so under Inductor the whole model is compiled either way
(the README's table beside HF's checkpointing measures both). Calls without labels (a loss
of the caller's own from the logits; TRL's SFTTrainer, whose fused LM head calls the backbone
directly and already walks the tokens in chunks of its own) go through the backbone's switch as
before.

Note [Logits in training calls]
A causal LM returns its logits beside its loss: a caller that holds them keeps one tokens x
vocabulary matrix whatever the plan. In a training call that passes labels, the loss is what
trainers read: Trainer's compute_loss takes `outputs["loss"]` (a compute_loss_func or label
smoother pops the labels first, so those calls keep their logits), Lightning modules return the
loss, and TRL's SFTTrainer reads its own fused head's outputs, not logits. So enable's default,
`logits="drop"`, returns `logits=None` from training calls with labels, and nothing builds them
whole; `logits="keep"` returns them (built whole, as the model writes them). Eval, no_grad and
generate calls are never compiled and return their logits.

Note [A training step's KV cache]
A Hugging Face causal LM returns its KV cache unless called with use_cache=False, and the cache is
a graph output: every block's keys and values stay alive from the forward to the backward whatever
the plan. HF's checkpointing switch passes use_cache=False in training, so a model switched from
it to enable, called the usual way (`model(input_ids=..., labels=...)`), would keep what it did
not keep before. So enable passes use_cache=False to the compiled training calls too, unless the
caller asked for a cache (use_cache=True; a causal-LM head hands its own use_cache argument on,
None when not given: the config's default), and then the backend's warning about held outputs
names the cost; generate, under no_grad, keeps its cache.

Note [A training call without its plan]
torch.compile may run a call uncompiled: past dynamo's recompile limit (8 graphs per function: a
static graph per input shape reaches it after 8 sequence lengths), or where it gave up on the
frame. Such a call keeps every activation, and where the model's own checkpointing was on, enable
had switched it off for the call: the step ran with less checkpointing than the model had. enable
sees it after the call (no graph of its backend ran; CkptBackend.graph_runs) and says so once, with
what to do; it cannot undo the step that ran.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_fx import policies
from ckpt_fx.dynamo_backend import CkptBackend, advisory_logging, backend
from passes._compat import current_recompile_limit, logging_calls_ignored
from passes.head import keeps_less_in_chunks
from passes.regions import block_stacks
from passes.targets import EAGER


@dataclass(frozen=True)
class _Switched:
    """What enable changed on one model, to undo it."""

    backend: CkptBackend
    forwards: tuple[tuple[torch.nn.Module, Any], ...]
    """Each module whose forward was switched (Note [The module enable switches], Note [The loss
    head under enable]) with its own `forward` attribute before enable (None: it had none, the
    class's ran)."""


_ENABLED: weakref.WeakKeyDictionary[torch.nn.Module, _Switched] = weakref.WeakKeyDictionary()


def enable(model: torch.nn.Module, policy: policies.Policy | str | None = None, *, compiler: str | None = None,
           strict: bool = False, dynamic: bool | None = None, head: str = "chunked",
           logits: str = "drop", progress: bool = True) -> CkptBackend:
    """Checkpoint `model`'s training steps with ckpt-fx, in place: its forward runs compiled with
    backend="ckpt" (and `policy`, `compiler`, `strict` as ckpt_fx.backend takes them) where
    gradients are recorded in train mode, and as it was anywhere else (eval, torch.no_grad,
    generate): no compile for those, no recompile for their shapes. The model keeps its class and
    state-dict keys, so Trainer, TRL and Lightning save and reload it as usual. Enabling again
    replaces the earlier settings. Returns the backend (its `plans` fill as graphs compile).
    `head`: "chunked" (a causal LM's loss head in chunks, Note [The loss head under enable]) or
    "whole". `logits`: "drop" (training calls with labels return logits=None, Note [Logits in
    training calls]) or "keep". `progress`: a line as each graph is planned and compiled, and its time
    (Note [The first step's lines] in ckpt_fx/dynamo_backend.py); False keeps them at debug level.

    >>> ckpt_fx.enable(model)                 # the default policy, before handing the model to a trainer
    >>> ckpt_fx.disable(model)                # the model as it was
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable: expected a torch.nn.Module, got {type(model).__name__}")
    # Every option checked here, now. `logits` acts only on a graph whose head was chunked: the
    # whole-model graphs of training calls with labels (the backbone's have no head).
    chosen = backend(policy=policy, compiler=compiler, strict=strict, head=head, logits=logits, progress=progress)
    disable(model)
    module = backbone(model)
    own = module.__dict__.get("forward")
    original = module.forward
    compiled = torch.compile(original, backend=chosen, dynamic=dynamic)
    whole_model = [False]  # within a compiled call of the head's module: the backbone runs as it is
    signature = inspect.signature(original)
    parameters = list(signature.parameters.values())
    # Where use_cache would be passed by position (none passes it so; it is then left as given).
    use_cache_at = next((i for i, p in enumerate(parameters) if p.name == "use_cache"), None)
    if use_cache_at is not None and parameters[use_cache_at].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
        use_cache_at = len(parameters)

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if whole_model[0] or not (self.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        with _own_checkpointing_off(self) as units:  # Note [The model's own checkpointing under enable]
            chosen.checkpointed_by_model = units
            # No KV cache in a training step, as HF's switch passes (Note [A training step's KV
            # cache]); where the model's own switch was on, as it would have, whatever was asked.
            if use_cache_at is not None and len(args) <= use_cache_at and (units or kwargs.get("use_cache") is None):
                kwargs["use_cache"] = False
            return _told_if_uncompiled(chosen, compiled, args, kwargs, units)

    module.forward = _bound_like(forward, original, module)
    switched = [(module, own)]
    top = _head_module(model, module) if head == "chunked" else None
    if top is not None:
        switched.append((top, top.__dict__.get("forward")))
        top.forward = _with_head(top, module, chosen, dynamic=dynamic, whole_model=whole_model)
    _ENABLED[model] = _Switched(backend=chosen, forwards=tuple(switched))
    return chosen


def _head_module(model: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module | None:
    """The backbone's parent when it holds output embeddings (a causal LM's head), else None (Note
    [The loss head under enable])."""
    for parent in model.modules():
        if any(child is module for child in parent.children()):
            get = getattr(parent, "get_output_embeddings", None)
            head = get() if callable(get) else None
            return parent if isinstance(head, torch.nn.Linear) else None
    return None


def _with_head(top: torch.nn.Module, module: torch.nn.Module, chosen: CkptBackend, *, dynamic: bool | None,
               whole_model: list[bool]) -> Any:
    """`top`'s forward switched: training calls with labels run compiled whole (Note [The loss head
    under enable]), the rest as they did."""
    original = top.forward
    compiled = torch.compile(original, backend=chosen, dynamic=dynamic)
    signature = inspect.signature(original)
    takes_use_cache = "use_cache" in signature.parameters
    prefix = next(name for name, m in top.named_modules() if m is module)

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("labels") is None or not (self.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        if chosen.target is EAGER and not _chunked_at(self, kwargs["labels"]):
            # A head one chunk would cover stays whole (SMALLER_ONLY in passes/head.py); whole, it
            # keeps less run eagerly beside the backbone than run as Python in its graph.
            return original(*args, **kwargs)
        with _own_checkpointing_off(module) as units:
            # A whole-model graph names its units from the model; where dynamo breaks the graph
            # before the blocks (peft's input-grad hook on the embedding), the frame it resumes
            # in is the backbone's, which names them from the backbone: each graph keeps its own.
            chosen.checkpointed_by_model = tuple(f"{prefix}.{u}" for u in units) + units
            if takes_use_cache and (units or kwargs.get("use_cache") is None):
                kwargs["use_cache"] = False  # Note [A training step's KV cache]
            whole_model[0] = True
            try:
                # transformers' loss functions log once per call (GPT-2's): traced as no-ops, not
                # as a graph break between the head's projection and its cross-entropy.
                with logging_calls_ignored(advisory_logging()):
                    return _told_if_uncompiled(chosen, compiled, args, kwargs, units)
            finally:
                whole_model[0] = False

    return _bound_like(forward, original, top)


def _chunked_at(top: torch.nn.Module, labels: Any) -> bool:
    """Whether the backend would put `top`'s loss head in chunks for a call with these labels
    (keeps_less_in_chunks at the projection's dtype: autocast's where it is on)."""
    head = top.get_output_embeddings()
    if not isinstance(labels, torch.Tensor) or not isinstance(head, torch.nn.Linear):
        return False
    weight = head.weight
    device = weight.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return keeps_less_in_chunks(tokens=labels.numel(), vocab=weight.shape[0], hidden=weight.shape[1], dtype=dtype,
                                weight_grad=weight.requires_grad)


def _told_if_uncompiled(chosen: CkptBackend, compiled: Any, args: tuple, kwargs: dict, units: tuple[str, ...]) -> Any:
    """compiled(*args, **kwargs), with a warning (once) where none of `chosen`'s graphs ran in it
    (Note [A training call without its plan])."""
    before = chosen.graph_runs
    result = compiled(*args, **kwargs)
    if chosen.graph_runs == before:
        own = (f", and without the model's own gradient checkpointing of its {len(units)} units, which enable "
               "switches off for the calls it compiles") if units else ""
        chosen.warn_once(
            f"ckpt_fx: a training call ran uncompiled, without ckpt-fx's plan{own}: it kept every activation. "
            f"torch.compile did not compile it: most often dynamo's recompile limit "
            f"(torch._dynamo.config.recompile_limit = {current_recompile_limit()}) was reached, a static graph "
            "compiled per input shape (TORCH_LOGS=recompiles shows why). Call ckpt_fx.enable(model, dynamic=True) "
            "so one graph serves every sequence length and batch size, pad inputs to a few lengths, or raise "
            "the limit")
    return result


def _bound_like(forward: Any, original: Any, module: torch.nn.Module) -> Any:
    """`forward` bound to `module` with `original`'s signature and name: trainers read the
    signature to choose which dataset columns to pass; wrappers that unwrap `forward.__func__`
    (accelerate's autocast) keep working."""
    signature = inspect.signature(original)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    forward.__name__, forward.__doc__ = getattr(original, "__name__", "forward"), getattr(original, "__doc__", None)
    return types.MethodType(forward, module)


@contextlib.contextmanager
def _own_checkpointing_off(module: torch.nn.Module) -> Iterator[tuple[str, ...]]:
    """Within: every `gradient_checkpointing` flag under `module` that was on is off, and the value
    is the units it checkpointed (paths from `module`); on exit the flags are back on (Note [The
    model's own checkpointing under enable])."""
    flagged = [(name, m) for name, m in module.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not flagged:
        yield ()
        return
    for _, m in flagged:
        m.gradient_checkpointing = False
    try:
        yield _units(module, [name for name, _ in flagged])
    finally:
        for _, m in flagged:
            m.gradient_checkpointing = True


def _units(module: torch.nn.Module, flagged: list[str]) -> tuple[str, ...]:
    """The units a model's own switch checkpoints, from the paths of its flagged modules: the
    flagged layers of a stack (Hugging Face's GradientCheckpointingLayer), or, where only a parent
    is flagged (older models, whose loop checkpoints each layer it calls), its stacks' layers."""
    layers = [name for name in flagged if name.rpartition(".")[2].isdigit()]
    if layers:
        return tuple(layers)
    found = []
    for parent in flagged:
        for stack in block_stacks(module.get_submodule(parent)):
            path = ".".join(p for p in (parent, stack) if p)
            found.extend(f"{path}.{k}" if path else k for k, _ in module.get_submodule(path).named_children())
    return tuple(dict.fromkeys(found))


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The smallest module holding every stack of repeated blocks (children named 0, 1, ... of one
    class), or `model` when it has none (Note [The module enable switches])."""
    stacks = block_stacks(model)
    if not stacks:
        return model
    parents = [name.rpartition(".")[0].split(".") if "." in name else [] for name in stacks]
    common = []
    for parts in zip(*parents):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return model.get_submodule(".".join(common)) if common else model


def disable(model: torch.nn.Module) -> None:
    """Undo enable: the model's forward is the one it had before (its compiled graphs go with the
    wrapper). Nothing happens to a model that is not enabled."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"disable: expected a torch.nn.Module, got {type(model).__name__}")
    switched = _ENABLED.pop(model, None)
    if switched is not None:
        _put_forwards(switched.forwards)


def _put_forwards(forwards: Iterable[tuple[torch.nn.Module, Any]]) -> None:
    """Give each module its `forward` attribute (None: none of its own, the class's runs)."""
    for module, forward in forwards:
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward


@contextlib.contextmanager
def own_forwards(model: torch.nn.Module) -> Iterator[None]:
    """A context in which an enabled model's modules run the forwards they had before enable (a
    copy made inside it, as explain makes, is a plain model); nothing changes for a model that is
    not enabled."""
    switched = _ENABLED.get(model)
    if switched is None:
        yield
        return
    current = [(module, module.__dict__.get("forward")) for module, _ in switched.forwards]
    _put_forwards(switched.forwards)
    try:
        yield
    finally:
        _put_forwards(current)


def enabled(model: torch.nn.Module) -> CkptBackend | None:
    """The backend enable gave `model`, or None when it is not enabled."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enabled: expected a torch.nn.Module, got {type(model).__name__}")
    switched = _ENABLED.get(model)
    return switched.backend if switched is not None else None
