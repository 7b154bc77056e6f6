"""The user's model object stays a whole Hugging Face model whose forward runs on the engine.

`Engine(model)` keeps `model` (the object the user holds, `engine.module`) as it is, except that:
- its parameters are the host store's FP32 masters (the resident embedding / final norm / LM head
  are the engine's device copies when the engine does not compute in FP32 on the CPU), so module
  attributes, `named_parameters()`, `state_dict()` and `save_pretrained()` see the trained weights,
  all of them, by construction; `state_dict()` always serves the FP32 masters, and so does
  `named_parameters()` / `parameters()` where a resident parameter's device copy is in another dtype (bf16
  compute: an FP32 copy of its master on the device, naming the copy it stands for), so every parameter the
  model object reports has the dtype its state dict and its optimizer have;
- `forward` is routed: a training or plain evaluation call runs the engine's streaming forward
  (chunked loss, logits when they are asked for or usable); a call with a KV cache, `use_cache`,
  `output_hidden_states` or `output_attentions` outside training (what `generate` does) runs the
  model's own forward with each layer's weights streamed to the device just before it runs;
- `load_state_dict` writes into the masters and refreshes every copy the engine keeps;
- with host_master 'hilo' or 'bf16' the decoder layers' Parameters are views of one shared FP32 scratch
  (NaN between updates, store.py): there are no FP32 masters to point at. `state_dict()` (so
  `save_pretrained()`) and `named_parameters()` / `parameters()` of the model then serve FP32 copies joined
  from the host store (`engine.state_dict()`'s values), and in-place writes through GatheredParameters are
  refused; a layer's Parameter read straight from its module is the scratch, never a weight;
- with nodes sharing one store (parallel/shared_store.py) another node's layers' Parameters here are one scratch:
  `state_dict()` (so `save_pretrained()`) serves their masters gathered from their owners, a collective every rank
  calls (a rank alone is refused within seconds), and so does an evaluation forward's loading;
  `named_parameters()` still yields the scratch for them (on purpose: serving their values would put a collective
  inside `parameters()`' generator, which callers consume on one rank or stop early; docs/DISTRIBUTED.md 5b);
- `.to()` / `.cuda()` / `.half()` and the like are refused when they would change anything (a no-op,
  or a move to the engine's own device, passes): they would cut the weights loose from the store the
  optimizer updates.

How: the binding is at class level, as FSDP2's `fully_shard` does it. The model's class becomes a generated
subclass of its own class (one per original class, cached) whose `forward`, `state_dict`, `named_parameters`,
`load_state_dict`, `_apply`, `__deepcopy__` and `__reduce_ex__` are defined below, so `type(model).forward` is
where `model(**batch)` goes; every submodule's class becomes a generated subclass that adds only the `_apply`
guard and pickles as its own class. Nothing is set on the instances but one entry, `_megatrain_binding` in the
model's `__dict__` (the engine, and the parameters it took). The generated classes keep their original's
`__name__`, `__qualname__` and `__module__`: Hugging Face writes `type(model).__name__` into a saved
config.json's `architectures` and picks the loss by it, Trainer, PEFT and TRL test class names, and the
engine's own checks match layer class names; `isinstance(model, OriginalClass)` holds, and a deep copy (or an
unpickled model) is a plain model of the original class. A face that serves a forward keyword of its own (TRL's
`fused_lm_head=True`) registers it on the binding (`serve_forward_keyword`) instead of replacing the forward.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import inspect
import itertools
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from ...costs.modes import HostMaster
from ...models.adapter import DecoderParts, stands_in
from ..host.store import HostStore
from ..layer.router import _RecordedStack
from ..parallel import shared_store
from ..pipeline.inference import streamed_layers
from ..pipeline.schedule import LayerPipeline


class Engine(Protocol):
    """What the model object needs of the engine that serves it (engine.py's Engine)."""

    module: nn.Module
    parts: DecoderParts
    hf_config: Any
    hf_attention: str | None
    store: HostStore
    pipeline: LayerPipeline
    device: torch.device
    placement: Any  # model/placement.py's Placement: the resident parameters' device copies
    node: Any  # the host store across ranks: parallel/shared_store.py's NodesShareStore where the nodes share one
    dp: Any  # parallel/distributed.py's DataParallel (None: one process)

    def forward(self, **kwargs: Any) -> Any: ...
    def synchronize(self) -> None: ...
    def global_masters(self) -> list[tuple[str, nn.Parameter]]: ...
    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None: ...

# Forward arguments that ask for HF's own forward (cache, per-layer outputs): served with streamed layers.
# (`cache` is transformers 5's name for `past_key_values`.)
_HF_ONLY = ("past_key_values", "cache", "use_cache", "cache_position", "output_hidden_states", "output_attentions")

_BINDING = "_megatrain_binding"  # the model's one instance entry: its _Binding
_PLAIN = "_megatrain_plain_class"  # a generated class's entry: the class it was generated from
# What the generated classes define; never on an instance of one
_ROUTED = ("forward", "state_dict", "named_parameters", "load_state_dict", "_apply", "__deepcopy__", "__reduce_ex__")

_bound: weakref.WeakSet = weakref.WeakSet()  # the live engines (an engine lives as long as its model)
_model_classes: dict[type, type] = {}  # original model class -> its generated, routed subclass
_guarded_classes: dict[type, type] = {}  # original submodule class -> its generated subclass with the _apply guard
_base_classes: dict[type, type] = {}  # original decoder base class -> its generated subclass with a routed forward


def engines_holding(tensors: list[torch.Tensor]) -> list[Engine]:
    """The live engines whose model object holds any of `tensors` as a parameter."""
    # a copy the model object served (named_parameters) stands for the parameter it names
    ids = {id(t) for t in tensors} | {id(t.megatrain_copy_of) for t in tensors if hasattr(t, "megatrain_copy_of")}
    # The plain class's named_parameters: the handles the model holds (the routed one may serve copies)
    return [e for e in list(_bound)
            if any(id(p) in ids for _, p in plain_class(type(e.module)).named_parameters(e.module))]


def plain_class(cls: type) -> type:
    """The class a generated (bound) class was made from; any other class itself."""
    return cls.__dict__.get(_PLAIN, cls)


class _Binding:
    """What a bound model holds of its engine: the engine, and the parameters and modules the engine took (a
    parameter or module swapped in afterwards would be served by some paths and not trained by others)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.keywords: dict[str, Callable[..., Any]] = {}  # forward keywords a face serves (serve_forward_keyword)
        self.expected = [(name, mod, leaf, p) for name, mod in engine.module.named_modules()
                         for leaf, p in mod._parameters.items() if p is not None]

    def check_intact(self) -> None:
        """Refuse every use of the model object until what was swapped in after the engine took it is put back."""
        for name, mod, leaf, p in self.expected:
            if mod._parameters.get(leaf) is not p:
                raise RuntimeError(f"{name + '.' if name else ''}{leaf} was replaced after MegaTrain took the model; the "
                                   "engine trains the tensors it holds. Write new values in place (under "
                                   "zero.GatheredParameters(..., modifier_rank=0)) or with load_state_dict()")
        engine = self.engine
        parts, model = engine.parts, engine.module
        if parts.other_head:
            head_replaced = _submodule(model, parts.head_name) is not parts.lm_head
            embed_replaced = _submodule(model, parts.base_prefix) is not parts.base or \
                parts.base.get_input_embeddings() is not parts.embed
        else:
            head_replaced = model.get_output_embeddings() is not parts.lm_head
            embed_replaced = model.get_input_embeddings() is not parts.embed
        if getattr(parts.base, parts.layers_attr) is not parts.layers or head_replaced or embed_replaced:
            raise RuntimeError("the model's layers or embeddings were replaced after MegaTrain took the model (e.g. "
                               "resize_token_embeddings); change the model before handing it to MegaTrain")


def bind(engine: Engine) -> None:
    """Route `engine.module`'s forward, state_dict, load_state_dict and conversions through `engine`: the model's
    class becomes its generated subclass, each submodule's class one that guards conversions. A model whose head is
    not a causal LM's (heads.py) keeps its own forward; its decoder base's forward is the one routed."""
    model = engine.module
    _bound.add(engine)
    binding = _Binding(engine)
    model.__dict__[_BINDING] = binding
    # A method set on the instance would hide the class's: TRL's fused-head forward (whose options the face read
    # before the engine took the model) goes, so does anything else in the way of the route.
    for name in _ROUTED:
        model.__dict__.pop(name, None)
    base = engine.parts.base if engine.parts.other_head else None
    for mod in model.modules():
        if mod is not model:
            mod.__dict__.pop("_apply", None)
            mod.__class__ = _guarded_class(plain_class(type(mod)))
    if base is not None:
        base.__dict__.pop("forward", None)
        base.__dict__[_BINDING] = binding
        base.__class__ = _base_class(plain_class(type(base)))
    model.__class__ = _model_class(plain_class(type(model)))
    if isinstance(engine.node, shared_store.NodesShareStore):
        # an evaluation forward's loads are the owners' broadcasts: a rank alone is refused, not left waiting
        shared_store.join_forwards(model, engine.parts.embed, engine.node)


def serve_forward_keyword(model: nn.Module, keyword: str, serve: Callable[..., Any]) -> None:
    """Let the bound `model`'s forward take `keyword`: a call with `keyword=True` returns
    `serve(routed, *args, **kwargs)`, `routed` being the model's engine-run forward bound to it (a face's head
    of its own, e.g. TRL's `fused_lm_head=True`), and `keyword=False` is dropped. Nothing is set on the model."""
    b = _binding(model)
    if b is None:
        raise ValueError(f"{type(model).__name__} is not served by a MegaTrain engine: build Engine(model) first")
    b.keywords[keyword] = serve


def _binding(model: nn.Module) -> _Binding | None:
    """`model`'s binding when an engine serves it (a model of a generated class built by hand has none)."""
    b = model.__dict__.get(_BINDING)
    return b if b is not None and b.engine.module is model else None


def _model_class(cls: type) -> type:
    """`cls`'s generated subclass whose methods route the bound model through its engine (cached per class)."""
    if cls not in _model_classes:
        _model_classes[cls] = type(cls)(cls.__name__, (cls,), {
            **_model_methods(cls), _PLAIN: cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__qualname__}, bound to a MegaTrain engine (megatrain/engine/model/model_object.py)"})
    return _model_classes[cls]


def _base_class(cls: type) -> type:
    """`cls`'s generated subclass for the decoder base of a model with a head of its own (cached per class): its
    forward is routed (`_route_base`), conversions guarded, a copy or pickle plain."""
    if cls not in _base_classes:
        original = cls.forward
        signature = inspect.signature(original)

        @functools.wraps(original, assigned=("__doc__", "__name__", "__annotations__"))
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            b = self.__dict__.get(_BINDING)
            # the engine's own calls of the base (its layers' inputs recorded) run the base's own code
            if b is None or b.engine.parts.base is not self or stands_in(getattr(self, b.engine.parts.layers_attr)):
                return original(self, *args, **kwargs)
            b.check_intact()
            return _route_base(b.engine, original, signature, self, args, kwargs)

        _base_classes[cls] = type(cls)(cls.__name__, (cls,), {
            "forward": forward, "_apply": _submodule_apply, "__reduce_ex__": _reduce_as_plain, _PLAIN: cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return _base_classes[cls]


def _guarded_class(cls: type) -> type:
    """`cls`'s generated subclass that refuses conversions of a module an engine holds (cached per class)."""
    if cls not in _guarded_classes:
        _guarded_classes[cls] = type(cls)(cls.__name__, (cls,), {
            "_apply": _submodule_apply, "__reduce_ex__": _reduce_as_plain, _PLAIN: cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return _guarded_classes[cls]


def _model_methods(plain: type) -> dict[str, Callable]:
    """The bound model class's own methods; a model of the class that no engine serves gets `plain`'s."""
    original = plain.forward
    signature = inspect.signature(original)

    # HF's signature and docs (Trainer keeps the dataset columns forward names, generate reads its arguments),
    # this module's name: `type(model).forward` shows where the route starts.
    @functools.wraps(original, assigned=("__doc__", "__name__", "__annotations__"))
    def forward(self: nn.Module, *args: Any, return_logits: bool | None = None, return_hidden: bool = False,
                **kwargs: Any) -> Any:
        b = _binding(self)
        if b is None or b.engine.parts.other_head or _engine_recording(b.engine, self):
            return original(self, *args, **kwargs)  # a head of the model's own: its base's forward is routed
        for keyword, serve in b.keywords.items():
            if kwargs.pop(keyword, False):
                return serve(types.MethodType(forward, self), *args, **kwargs)
        b.check_intact()
        return _route(b.engine, original, signature, self, args, kwargs, return_logits, return_hidden)

    @functools.wraps(nn.Module.state_dict, assigned=("__doc__", "__name__"))
    def state_dict(self: nn.Module, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        b = _binding(self)
        if b is not None:
            b.check_intact()
            b.engine.synchronize()  # overlapped layer updates land first: never a half-updated snapshot
        out = plain.state_dict(self, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if b is not None:
            _serve_masters(b.engine, plain, self, out, prefix, keep_vars)
        return out

    @functools.wraps(nn.Module.named_parameters, assigned=("__doc__", "__name__"))
    def named_parameters(self: nn.Module, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        items = plain.named_parameters(self, prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
        b = _binding(self)
        resident = _resident_copies(b.engine) if b is not None else {}
        if b is None or (b.engine.store.master_mode is HostMaster.FP32 and not resident):
            yield from items
            return
        b.check_intact()
        b.engine.synchronize()
        slots = _layer_slots(b.engine) if b.engine.store.master_mode is not HostMaster.FP32 else {}
        for name, p in items:
            master = resident.get(id(p))
            if master is not None:
                # a resident parameter's compute copy (bf16): its FP32 master's values instead, as state_dict()
                # serves them, on the copy's device (`model.device` stays the engine's), naming the copy it stands for
                copy_ = nn.Parameter(master.detach().to(p.device, copy=True), requires_grad=p.requires_grad)
                copy_.megatrain_copy_of = p
                yield name, copy_
                continue
            where = slots.get(id(p))
            if where is None:
                yield name, p
                continue
            # a copy of the master's values, flagged as the user set the parameter (engine/model/trainable.py), that
            # names the parameter it copies (a clip_grad_norm_ over model.parameters() finds its gradient by it)
            copy_ = nn.Parameter(where[0].read_slot(where[1]), requires_grad=p.requires_grad)
            copy_.megatrain_copy_of = p
            yield name, copy_

    @functools.wraps(nn.Module.load_state_dict, assigned=("__doc__", "__name__"))
    def load_state_dict(self: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        b = _binding(self)
        if b is None:
            return plain.load_state_dict(self, state_dict, strict=strict, assign=assign)
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the tensors the engine trains; "
                             "call it with assign=False (the default)")
        return _load(b.engine, plain, self, state_dict, strict)

    def _apply(self: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        b = _binding(self)
        if b is None:
            return plain._apply(self, fn, *args, **kwargs)
        return _guarded_apply(b.engine, self, fn)

    def __deepcopy__(self: nn.Module, memo: dict) -> nn.Module:
        # A copy (a reference or EMA model) is a plain model of the original class with weights of its own and
        # the model's own attention (the engine switched the shared config to segment attention, which knows no
        # KV cache). Its submodules turn plain as they are copied (_reduce_as_plain).
        b = _binding(self)
        new = plain.__new__(plain)
        memo[id(self)] = new
        state = {k: v for k, v in self.__getstate__().items() if k != _BINDING}
        with _own_attention(b.engine) if b is not None else nullcontext():
            new.__setstate__(copy.deepcopy(state, memo))
        return new

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        # Pickled as the plain copy (torch.save(model)): the original class, own attention, no engine.
        return _as_plain(plain, copy.deepcopy(self).__getstate__())

    return {"forward": forward, "state_dict": state_dict, "named_parameters": named_parameters,
            "load_state_dict": load_state_dict, "_apply": _apply, "__deepcopy__": __deepcopy__,
            "__reduce_ex__": __reduce_ex__}


def _serve_masters(engine: Engine, plain: type, model: nn.Module, out: dict[str, Any], prefix: str,
                   keep_vars: bool) -> None:
    """Put the FP32 masters into `out` (a state dict of `model` under `prefix`) where the model's own
    Parameters are device copies or the shared scratch."""
    for name, master in engine.global_masters():
        if prefix + name in out:  # the device copy may be bf16: serve the exact FP32 master instead
            out[prefix + name] = master if keep_vars else master.detach()
    if engine.store.master_mode is not HostMaster.FP32:
        # The layers' Parameters are the shared scratch: serve the masters joined from the host store.
        slots = _layer_slots(engine)
        for name, p in plain.named_parameters(model, remove_duplicate=False):
            where = slots.get(id(p))
            # (another node's layer, in the nodes' shared store, has no values here: served below)
            if where is not None and (where[0].owned or not engine.store.across_nodes) and prefix + name in out:
                value = where[0].read_slot(where[1])
                out[prefix + name] = nn.Parameter(value, requires_grad=p.requires_grad) if keep_vars else value
    if isinstance(engine.node, shared_store.NodesShareStore):
        # The other nodes' layers' Parameters are one scratch here: their masters, gathered from their owners
        # (collective: every rank calls state_dict, as engine.state_dict(); a rank alone is refused at once).
        flags = {n: p.requires_grad for n, p in plain.named_parameters(model, remove_duplicate=False)}
        for name, value in shared_store.other_nodes_layers(engine.node, engine.store, engine.parts.layers_prefix,
                                                           engine.dp).items():
            if prefix + name in out:
                out[prefix + name] = nn.Parameter(value, requires_grad=flags.get(name, True)) if keep_vars else value


def _engine_recording(engine: Engine, model: nn.Module) -> bool:
    # The engine itself runs the model's own forward with its stand-in for the decoder stack, to take the
    # router term of a mixture-of-experts loss (layer/router.py): that call is the class's own forward.
    prefix = engine.parts.base_prefix
    try:
        return bool(prefix) and isinstance(model.get_submodule(prefix), _RecordedStack)
    except AttributeError:  # the stack is gone: check_intact says so
        return False


@contextmanager
def _own_attention(engine: Engine) -> Iterator[None]:
    """The model's own attention implementation on the shared config, for its own forward or a plain copy."""
    config = engine.hf_config
    training_attention, config._attn_implementation = config._attn_implementation, engine.hf_attention
    try:
        yield
    finally:
        config._attn_implementation = training_attention  # segment attention knows no KV cache


def _submodule_apply(self: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
    engine = next((e for e in list(_bound) if any(m is self for m in e.module.modules())), None)
    if engine is None:  # no engine holds it (taken out of the model): a plain module of its own
        return plain_class(type(self))._apply(self, fn, *args, **kwargs)
    return _guarded_apply(engine, self, fn)


def _reduce_as_plain(self: nn.Module, protocol: Any) -> Any:
    # A copied or pickled submodule is an instance of its original class (deepcopy and pickle both reduce).
    return _as_plain(plain_class(type(self)), self.__getstate__())


def _as_plain(plain: type, state: dict[str, Any]) -> tuple:
    """A reduction to an instance of `plain` with `state` (nn.Module.__setstate__ takes it). Made by the
    standard library's own reconstructor (what protocols 0 and 1 use): loading needs no MegaTrain."""
    return copyreg._reconstructor, (plain, object, None), state


def _route(engine: Engine, original: Any, signature: inspect.Signature, model: nn.Module, args: tuple,
           kwargs: dict[str, Any], return_logits: bool | None, return_hidden: bool = False) -> Any:
    kw = _named_arguments(signature, model, args, kwargs)
    train = model.training and torch.is_grad_enabled()
    wants_hf = any(_given(kw.get(k)) for k in _HF_ONLY)
    if wants_hf and not train:
        return _streamed_hf_forward(engine, original, model, kw, return_logits)
    if wants_hf:
        asked = sorted(k for k in _HF_ONLY if k != "use_cache" and _given(kw.get(k)))
        if asked:
            raise ValueError(f"{asked} in a training forward: the training path keeps no KV cache and no per-layer "
                             "outputs. Call model.eval() or run under torch.no_grad() for generation and "
                             "inspection, or drop these arguments to train")
        # use_cache=True while training is ignored, as Hugging Face does under gradient checkpointing.
    for k in _HF_ONLY:
        kw.pop(k, None)
    return_dict = kw.pop("return_dict", None)
    if kw.pop("inputs_embeds", None) is not None:
        raise ValueError("inputs_embeds is not supported by the MegaTrain engine; pass input_ids")
    labels = kw.pop("labels", None)
    call = {k: kw.pop(k, None) for k in ("input_ids", "attention_mask", "position_ids", "num_items_in_batch",
                                         "output_router_logits")}
    _drop_packing_kwargs(kw, call["position_ids"])
    logits_to_keep = kw.pop("logits_to_keep", 0)
    rest = sorted(k for k, v in kw.items() if v is not None)
    if rest:
        raise TypeError(f"forward() got arguments the MegaTrain engine does not serve: {rest}; it takes input_ids, "
                        "attention_mask, position_ids, labels, num_items_in_batch, output_router_logits, "
                        "logits_to_keep, return_dict, return_logits, return_hidden (and, outside training, "
                        "past_key_values / use_cache / output_hidden_states / output_attentions)")
    if return_logits is None:
        # Logits whenever the caller can use them; a training step with labels takes the memory-lean chunked loss.
        return_logits = not (train and labels is not None)
    out = engine.forward(labels=labels, return_logits=return_logits, logits_to_keep=logits_to_keep,
                         return_hidden=return_hidden, **call)
    return out.to_tuple() if return_dict is False else out


def _route_base(engine: Engine, original: Any, signature: inspect.Signature, base: nn.Module, args: tuple,
                kwargs: dict[str, Any]) -> Any:
    """The decoder base's forward under a head of the model's own: the engine's streamed forward, its final norm's
    output as `last_hidden_state` (what the base's own forward returns), for the model's forward to apply its head
    to; its gradient (and the head's) reach the engine through `engine.backward(loss)`. Outside training, a KV cache
    or per-layer outputs run the base's own forward with the layers streamed, as generation does."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    kw = _named_arguments(signature, base, args, kwargs)
    train = base.training and torch.is_grad_enabled()
    if any(_given(kw.get(k)) for k in _HF_ONLY):
        if not train:
            return _streamed_hf_forward(engine, original, base, kw, None)
        asked = sorted(k for k in _HF_ONLY if k != "use_cache" and _given(kw.get(k)))
        if asked:
            raise ValueError(f"{asked} in a training forward: the training path keeps no KV cache and no per-layer "
                             "outputs. Call model.eval() or run under torch.no_grad() for inspection, or drop these "
                             "arguments to train")
    for k in (*_HF_ONLY, "head_mask"):  # no head_mask: DeepSpeed-Chat's reward model hands non-Llama bases None
        if k == "head_mask" and kw.get(k) is not None:
            raise TypeError("head_mask is not served by the MegaTrain engine")
        kw.pop(k, None)
    return_dict = kw.pop("return_dict", None)
    if kw.pop("inputs_embeds", None) is not None:
        raise ValueError("inputs_embeds is not supported by the MegaTrain engine; pass input_ids")
    call = {k: kw.pop(k, None) for k in ("input_ids", "attention_mask", "position_ids")}
    _drop_packing_kwargs(kw, call["position_ids"])
    rest = sorted(k for k, v in kw.items() if v is not None)
    if rest:
        raise TypeError(f"{type(base).__name__}.forward() got arguments the MegaTrain engine does not serve: {rest}; "
                        "it takes input_ids, attention_mask, position_ids, return_dict (and, outside training, "
                        "past_key_values / use_cache / output_hidden_states / output_attentions)")
    if call["input_ids"] is None:
        raise ValueError(f"{type(base).__name__}.forward() needs input_ids on the MegaTrain engine")
    # No router term: a head of the model's own adds none (transformers' *ForSequenceClassification does not).
    out = engine.forward(**call, return_hidden=True, output_router_logits=False)
    hidden = BaseModelOutputWithPast(last_hidden_state=out.hidden_states[0])
    return hidden.to_tuple() if return_dict is False else hidden


# What padding-free collators (TRL's packing, DataCollatorWithFlattening) add for flash attention. They restate the
# sequence boundaries that position_ids already give (a reset to 0 starts a sequence); the model's own mask, which
# the engine records, is built from position_ids, as it is on plain HF with any other attention.
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _drop_packing_kwargs(kw: dict[str, Any], position_ids: torch.Tensor | None) -> None:
    given = {k: kw.pop(k) for k in _PACKING_KWARGS if kw.get(k) is not None}
    cu = given.get("cu_seq_lens_q", given.get("cu_seq_lens_k"))
    if not given or cu is None:
        if given:
            kw.update(given)  # refused below, by name: boundaries without cu_seq_lens are not ones we can check
        return
    if position_ids is None:
        raise ValueError("cu_seq_lens_q/k without position_ids: the engine reads packed sequences' boundaries from "
                         "position_ids (0 where each sequence starts); pass them, as padding-free collators do")
    flat = position_ids.reshape(-1).cpu()
    starts = torch.cat([(flat == 0).nonzero().squeeze(1), torch.tensor([flat.numel()])])
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if name in given and not torch.equal(given[name].reshape(-1).cpu().long(), starts):
            raise ValueError(f"{name} does not match the sequence starts in position_ids ({starts.tolist()}): the "
                             "engine takes packed sequences' boundaries from position_ids")


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _resident_copies(engine: Engine) -> dict[int, nn.Parameter]:
    """id(resident parameter's device copy) -> its FP32 master, where the copy is in another dtype (bf16 compute)."""
    group = engine.store.globals
    return {id(d): m for d, m in zip(engine.placement.device_globals, group.params) if d.dtype != m.dtype}


def _layer_slots(engine: Engine) -> dict[int, tuple[Any, Any]]:
    """id(layer Parameter) -> (its FlatGroup, its Slot): where a scratch-backed Parameter's values live."""
    return {id(p): (g, s) for g in engine.store.layers for s, p in zip(g.slots, g.params)}


def _given(value: Any) -> bool:
    return value is not None and value is not False  # never `in (None, False)`: a tensor would compare elementwise


def _named_arguments(signature: inspect.Signature, model: nn.Module, args: tuple,
                     kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, as the model's own forward would bind them."""
    bound = signature.bind(model, *args, **kwargs)
    out: dict[str, Any] = {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        kind = signature.parameters[name].kind
        if i == 0:
            continue  # self
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"forward() got {len(value)} unexpected positional arguments")
        else:
            out[name] = value
    return out


def hf_forward(engine: Engine, **kwargs: Any) -> Any:
    """The model's own Hugging Face forward (its own attention implementation, KV cache and all) with the
    layers streamed, under no_grad: what `generate` runs, and a reference for the engine's training path."""
    return _streamed_hf_forward(engine, plain_class(type(engine.module)).forward, engine.module, kwargs, None)


def _streamed_hf_forward(engine: Engine, original: Any, model: nn.Module, kw: dict[str, Any],
                         return_logits: bool | None) -> Any:
    if return_logits is False:
        raise ValueError("return_logits=False with a KV cache or per-layer outputs: the model's own forward "
                         "always computes logits")
    dev = engine.device
    kw = {k: v.to(dev) if torch.is_tensor(v) and k != "num_items_in_batch" else v for k, v in kw.items()}
    engine.synchronize()  # overlapped layer updates land before their weights are streamed
    with _own_attention(engine), torch.no_grad(), streamed_layers(engine.pipeline, engine.store, engine.parts.layers):
        return original(model, **kw)


def _load(engine: Engine, plain: type, model: nn.Module, state: dict[str, torch.Tensor], strict: bool) -> Any:
    from torch.nn.modules.module import _IncompatibleKeys

    params = dict(plain.named_parameters(model, remove_duplicate=False))  # names only: no joined copies
    buffers = {n: b for n, b in model.named_buffers() if n.rpartition(".")[2] not in
               model.get_submodule(n.rpartition(".")[0])._non_persistent_buffers_set}
    missing = sorted(n for n in itertools.chain(params, buffers) if n not in state)
    unexpected = sorted(n for n in state if n not in params and n not in buffers)
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_state_dict: missing keys {missing[:5]} ({len(missing)} in all), unexpected keys "
                           f"{unexpected[:5]} ({len(unexpected)} in all); pass strict=False to load a subset")
    engine.load_state_dict({n: t for n, t in state.items() if n in params}, strict=False)
    with torch.no_grad():
        for n, b in buffers.items():
            if n in state:
                b.copy_(state[n])
    return _IncompatibleKeys(missing, unexpected)


def _guarded_apply(engine: Engine, module: nn.Module, fn: Any) -> nn.Module:
    """`module` (held by `engine`) unchanged when `fn` would change nothing; else refuse."""
    # An empty tensor of each dtype/device the module holds shows what the conversion would do, without
    # copying anything: a no-op (model.to(its own device)) passes, anything else would detach the weights.
    for t in itertools.chain(module.parameters(), module.buffers()):
        probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        # Moving to the engine's own device is what the engine does anyway (layers stream there).
        to_engine = probe.device.type == engine.device.type and engine.device.index in (None, probe.device.index)
        if probe.dtype != t.dtype or (probe.device != t.device and not to_engine):
            raise RuntimeError(
                f"{type(module).__name__}: this conversion would move or cast {t.dtype} tensors on {t.device} to "
                f"{probe.dtype} on {probe.device}, cutting them loose from the MegaTrain engine's host store. The "
                f"engine places the weights itself (compute on {engine.device}); to get a plain copy elsewhere, "
                "save_pretrained() and load it with from_pretrained()")
    return module
