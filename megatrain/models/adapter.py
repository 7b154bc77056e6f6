"""Find the parts of a Hugging Face decoder-only causal LM that the engine streams or keeps resident.

The adapter describes a model; it never runs it. Model-level math that happens before the first
layer (masks, rotary tables, embedding scales) is captured by running the model's own forward with
the layers replaced by recorders for the duration of that call (see `LayerInputRecorder`), so it
stays exactly the model's.
"""

from __future__ import annotations

import copy
import inspect
import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LogitTransform:
    """Scalar math a model's wrapper does on its logits, in HF's order: `z * scale` (Cohere's logit_scale,
    Granite's 1 / logits_scaling), then `softcap * tanh(z / softcap)` (Gemma 2)."""

    scale: float | None = None
    softcap: float | None = None


# Post-layer math in the *ForCausalLM wrapper that our chunked head would silently skip.
_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")
_LAYER_STACK_NAMES = ("layers", "h", "blocks", "decoder_layers")


@dataclass
class DecoderParts:
    model: nn.Module  # the *ForCausalLM module
    base: nn.Module  # the decoder stack that owns embedding, layers and final norm
    base_prefix: str  # its dotted name inside `model` ("model" for Llama)
    layers_attr: str  # attribute of `base` holding the nn.ModuleList of decoder layers
    layers: nn.ModuleList
    embed: nn.Embedding
    norm: nn.Module
    lm_head: nn.Linear
    rotary: nn.Module | None
    tied: bool
    # The head's scalar math: a float is final_logit_softcapping (logits = c * tanh(logits / c)); a LogitTransform
    # adds a scale (logit_scale, logits_scaling). The loss functions take either under this name.
    softcap: float | LogitTransform | None = None
    # A head other than a causal LM's (sequence classification's `score`, a reward wrapper's `v_head`): its dotted
    # name in `model`, whose own forward applies it to the base's output (`lm_head` is that module); None for a
    # causal LM. The engine then serves the base's forward (its last hidden state), not the model's.
    head_name: str | None = None

    @property
    def other_head(self) -> bool:
        return self.head_name is not None

    @property
    def layers_prefix(self) -> str:
        return f"{self.base_prefix}.{self.layers_attr}" if self.base_prefix else self.layers_attr


def _module_name(root: nn.Module, target: nn.Module) -> str | None:
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None


def find_parts(model: nn.Module) -> DecoderParts:
    """Locate embedding, layer stack, final norm, LM head and rotary embedding, or explain what is missing."""
    config = getattr(model, "config", None)
    kind = type(model).__name__
    if config is None:
        if _decoder_inside(model) is not None:
            raise ValueError(f"{kind} holds a decoder but has no `.config`: set `self.config = base.config` in its "
                             "__init__ (the base model's own config object, as DeepSpeed-Chat's RewardModel does)")
        raise ValueError(f"{kind} has no `.config`: MegaTrain needs a Hugging Face PreTrainedModel")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{kind} is an encoder-decoder model; MegaTrain trains decoder-only causal LMs")
    scale = _logit_scale(model, config, kind)
    if getattr(config, "num_kv_shared_layers", None):
        raise ValueError(f"{kind} shares keys/values across layers (num_kv_shared_layers="
                         f"{config.num_kv_shared_layers}): its layers are not independent, so they cannot be "
                         "recomputed one at a time; set num_kv_shared_layers=0 or train it with another backend")

    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed = get_in() if get_in else None
    lm_head = get_out() if get_out else None
    if not _linear_head(lm_head) and _other_head(model) is not None:
        return _head_parts(model, config, kind)
    if not isinstance(embed, nn.Embedding):
        raise ValueError(f"{kind}: no input embedding (nn.Embedding) found via get_input_embeddings()")
    if not _linear_head(lm_head):
        raise ValueError(f"{kind}: no LM head (nn.Linear) found via get_output_embeddings(); is it a *ForCausalLM?")

    n_layers = getattr(config, "num_hidden_layers", None)
    base = None
    for mod in model.modules():
        if mod is model:
            continue
        for attr in _LAYER_STACK_NAMES:
            stack = getattr(mod, attr, None)
            if isinstance(stack, nn.ModuleList) and len(stack) > 0 and (n_layers is None or len(stack) == n_layers):
                base, layers_attr = mod, attr
                break
        if base is not None:
            break
    if base is None:
        raise ValueError(f"{kind}: no decoder layer stack found (an nn.ModuleList named one of "
                         f"{_LAYER_STACK_NAMES} with num_hidden_layers={n_layers} entries)")
    if _module_name(base, embed) is None:
        raise ValueError(f"{kind}: the input embedding does not live in the decoder stack {type(base).__name__}")
    norm = find_final_norm(base, layers_attr, embed, kind)
    rotary = getattr(base, "rotary_emb", None)
    base_prefix = _module_name(model, base)
    tied = lm_head.weight is embed.weight
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, int | float) or softcap <= 0):
        raise ValueError(f"{kind}: final_logit_softcapping={softcap!r} must be a positive number or None")
    cap = float(softcap) if softcap is not None else None
    return DecoderParts(model, base, base_prefix or "", layers_attr, getattr(base, layers_attr), embed, norm,
                        lm_head, rotary, tied, cap if scale is None else LogitTransform(scale, cap))


def _linear_head(head: object) -> bool:
    """A linear LM head, or PEFT's `modules_to_save` wrapper around one (its `weight` and `bias` are the active
    adapter's trained copy, or the original's with adapters disabled: the head's tensors are read per call)."""
    return isinstance(head, nn.Linear) or (isinstance(getattr(head, "original_module", None), nn.Linear)
                                           and isinstance(getattr(head, "modules_to_save", None), nn.ModuleDict))


def _other_head(model: nn.Module) -> str | None:
    """The name of a head other than a causal LM's on a decoder (`score` of *ForSequenceClassification, a reward or
    value wrapper's `v_head`): a linear outside the decoder base, beside it."""
    found = _decoder_inside(model)
    if found is None:
        return None
    prefix = found[0] + "."
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not name.startswith(prefix) and name != found[0]:
            return name
    return None


def find_other_head(model: nn.Module) -> tuple[str, str] | None:
    """(the decoder base's dotted name, the head's) when `model` is a decoder under a head other than a causal LM's
    (see DecoderParts.head_name); None otherwise. Nothing is run."""
    get_out = getattr(model, "get_output_embeddings", None)
    if isinstance(get_out() if get_out else None, nn.Linear):
        return None
    found, head = _decoder_inside(model), _other_head(model)
    return None if found is None or head is None else (found[0], head)


def _decoder_inside(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(dotted name, module) of the Hugging Face decoder base `model` holds below itself: the outermost
    PreTrainedModel submodule with an input embedding and a decoder layer stack (LlamaModel in
    LlamaForSequenceClassification, `rwtranrsformer` in DeepSpeed-Chat's RewardModel), or None."""
    from transformers import PreTrainedModel

    for name, mod in model.named_modules():
        if mod is model or not isinstance(mod, PreTrainedModel):
            continue
        get_in = getattr(mod, "get_input_embeddings", None)
        try:
            embed = get_in() if get_in else None
        except (NotImplementedError, AttributeError):
            embed = None
        if isinstance(embed, nn.Embedding) and any(
                isinstance(getattr(mod, a, None), nn.ModuleList) for a in _LAYER_STACK_NAMES):
            return name, mod
    return None


def _head_parts(model: nn.Module, config: object, kind: str) -> DecoderParts:
    """The parts of a decoder under a head other than a causal LM's (see DecoderParts.head_name): the base streamed
    as under a causal LM's head, everything outside it (the head) resident and applied by the model's own forward
    to the base's last hidden state. Refused: a base of another config object (the engine switches the shared
    config's attention), a causal LM's head inside the model (the wrapper then holds a whole causal LM, whose own
    forward the engine does not serve), a base whose layer stack or final norm is not found."""
    base_prefix, base = _decoder_inside(model)
    if base.config is not config:
        raise ValueError(f"{kind}.config is not its decoder base's config ({base_prefix}.config): the engine sets the "
                         "attention implementation on the model's config, which the base's layers must read; set "
                         f"`self.config = {base_prefix}.config`")
    outside = [(n, m) for n, m in model.named_modules() if n != base_prefix and not n.startswith(base_prefix + ".")]
    lm = next((n for n, m in outside if isinstance(m, nn.Linear)
               and m.out_features == getattr(config, "vocab_size", None)), None)
    if lm is not None:
        raise ValueError(f"{kind} holds a causal LM's head `{lm}` besides its decoder `{base_prefix}`: MegaTrain "
                         "serves the decoder base's forward under a head of the model's own (a score or value head); "
                         "build the wrapper over the causal LM's base model (`AutoModelForCausalLM(...).model`)")
    inner = find_parts_of_base(base, config, kind)
    head_name = _other_head(model)
    head = model.get_submodule(head_name)
    return DecoderParts(model, base, base_prefix, inner.layers_attr, inner.layers, inner.embed, inner.norm, head,
                        inner.rotary, False, None, head_name)


def find_parts_of_base(base: nn.Module, config: object, kind: str) -> DecoderParts:
    """A decoder base's embedding, layer stack, final norm and rotary embedding (no head: `lm_head` is None)."""
    n_layers = getattr(config, "num_hidden_layers", None)
    layers_attr = next((a for a in _LAYER_STACK_NAMES if isinstance(getattr(base, a, None), nn.ModuleList)
                        and (n_layers is None or len(getattr(base, a)) == n_layers)), None)
    if layers_attr is None:
        raise ValueError(f"{kind}: no decoder layer stack found in {type(base).__name__} (an nn.ModuleList named one "
                         f"of {_LAYER_STACK_NAMES} with num_hidden_layers={n_layers} entries)")
    embed = base.get_input_embeddings()
    norm = find_final_norm(base, layers_attr, embed, kind)
    return DecoderParts(base, base, "", layers_attr, getattr(base, layers_attr), embed, norm, None,
                        getattr(base, "rotary_emb", None), False)


class _PassThrough(nn.Module):
    """Stands in for a decoder layer while the final norm is traced: hands the loop its hidden state back, and
    answers what the loop asks of the layer (its attention or block type) as the layer would.

    `as_tuple`: hands it back as a one-tuple that the next stand-in unwraps (`_LayerOutput`), for loops that index
    what a layer returns; a loop that takes it as the hidden state then fails at the final norm, and is traced
    again without. Given a `runner` (layer 0), it runs it once and hands back, from every stand-in, what it handed
    back besides the hidden state, so a loop that unpacks more (state handed between layers) runs."""

    def __init__(self, original: nn.Module, shared: dict, as_tuple: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.__dict__["_original"] = weakref.ref(original)  # not a submodule, and not copied with the stack
        self.__dict__["_runner"] = None
        self.shared = shared
        self.as_tuple = as_tuple
        self.dtype = dtype

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_original"](), name)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if isinstance(hidden_states, _LayerOutput):
            hidden_states = hidden_states[0]
        if hidden_states.is_floating_point():
            # As the engine's layers hand it on: in the model's dtype (XGLM's FP32 positions make a bf16 model's
            # layer input FP32; record_layer_inputs casts it too).
            hidden_states = hidden_states.to(self.dtype)
        if self.as_tuple:
            return _LayerOutput((hidden_states,))
        runner = self.__dict__["_runner"]
        if runner is not None and "out" not in self.shared:
            self.shared["out"] = runner(hidden_states, *args, **kwargs)
        out = self.shared.get("out")
        if isinstance(out, tuple) and out:
            return (hidden_states, *out[1:])
        return hidden_states


_HOOKED = "_output_capturing_hooks_installed"
_ABSENT = object()
# How the trace stands in for the layers, in order: a one-tuple; the hidden state; layer 0's output's shape.
_TRACES = ((True, False), (False, False), (False, True))


def _modules_after_loop(base: nn.Module, layers_attr: str, embed: nn.Module, as_tuple: bool,
                        first_real: bool) -> list[tuple[str, tuple, dict, object]]:
    """Run `base` on two tokens with its layers standing in (`_PassThrough`) and return the last layer's call and
    the calls of the stack's direct children after it, in order: (name, args, kwargs, output). `first_real`: layer
    0 runs for real (once, on those two tokens). A model on the meta device (a skeleton, the planner's shapes) is
    traced on an uninitialised CPU copy of its stack without the layers: only which modules run matters, and pages
    never written cost no memory."""
    layers = getattr(base, layers_attr)
    shared: dict = {}
    stand_ins = nn.ModuleList(_PassThrough(layer, shared, as_tuple, embed.weight.dtype) for layer in layers)
    setattr(base, layers_attr, stand_ins)
    try:
        runner = layers[0] if first_real else None
        tensors = [*base.parameters(), *base.buffers(), *(runner.parameters() if runner is not None else ())]
        run, device = base, embed.weight.device
        if any(t.is_meta for t in tensors):
            run, device = copy.deepcopy(base).to_empty(device="cpu"), torch.device("cpu")
            runner = copy.deepcopy(runner).to_empty(device="cpu") if runner is not None else None
        getattr(run, layers_attr)[0].__dict__["_runner"] = runner
        return _trace(run, getattr(run, layers_attr), device)
    finally:
        setattr(base, layers_attr, layers)


def _trace(base: nn.Module, stand_ins: nn.ModuleList, device: torch.device) -> list[tuple[str, tuple, dict, object]]:
    """`base` on two tokens, its children's calls from the last stand-in's on (see _modules_after_loop)."""
    # Token ids, not embeddings: some stacks derive more inputs from the ids (Gemma 4's per-layer embeddings).
    ids = torch.tensor([[1, 2]], device=device)
    calls: list = []

    def record(name: str):
        return lambda mod, args, kwargs, out: calls.append((name, args, kwargs, out))

    hooks = [child.register_forward_hook(record(name), with_kwargs=True)
             for name, child in base.named_children() if child is not stand_ins]
    hooks.append(stand_ins[-1].register_forward_hook(record("\0loop"), with_kwargs=True))
    modes = {m: m.training for m in base.modules()}
    base.eval()  # no dropout draws: the caller's random stream stays as it was
    # transformers installs its output-capturing hooks (router logits, ...) on a model's first call, once: marked as
    # installed for the trace, so that the first real call installs them on the real layers, not on the stand-ins.
    from transformers import PreTrainedModel

    hooked = {m: vars(m).get(_HOOKED, _ABSENT) for m in base.modules() if isinstance(m, PreTrainedModel)}
    try:
        for m in hooked:
            setattr(m, _HOOKED, True)
        with torch.no_grad():
            base(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
        for m, was in hooked.items():
            if was is _ABSENT:
                delattr(m, _HOOKED)
            else:
                setattr(m, _HOOKED, was)
    ends = [i for i, c in enumerate(calls) if c[0] == "\0loop"]
    if not ends:
        raise RuntimeError(f"{type(base).__name__}.forward never called its last decoder layer")
    return calls[ends[-1]:]


class FinalChain(nn.Module):
    """Modules a stack applies one after the other to the last layer's output (DeepSeek-V4's hyper-connection
    head, which folds its residual streams into one, then its norm): the engine's final norm is their composition."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.chain = nn.ModuleList(modules)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for mod in self.chain:
            hidden_states = mod(hidden_states)
        return hidden_states


def find_final_norm(base: nn.Module, layers_attr: str, embed: nn.Module, kind: str) -> nn.Module:
    """The final norm: what the decoder stack's forward applies to the last layer's output, found by running the
    stack with its layers standing in (not by its name: LFM2's is `embedding_norm`). One module, or several applied
    one after the other, each to the previous one's output alone (`FinalChain`); anything else is refused by name."""
    failures = []
    for as_tuple, first_real in _TRACES:
        try:
            calls = _modules_after_loop(base, layers_attr, embed, as_tuple, first_real)
            break
        except Exception as exc:  # noqa: BLE001 - each way of standing in is tried; all failures are reported
            failures.append(f"{type(exc).__name__}: {exc}")
    else:
        raise ValueError(f"{kind}: no final norm found: running {type(base).__name__}'s forward with its decoder "
                         "layers standing in, to see which module it applies after them, failed (" +
                         "; ".join(failures) + ")")
    loop_out, after = calls[0][3], calls[1:]
    after = [c for c in after if not isinstance(getattr(base, c[0]), nn.Dropout)]  # identity in eval and at p=0
    x = loop_out[0] if isinstance(loop_out, tuple) else loop_out
    names = [c[0] for c in after]
    for name, args, kwargs, out in after:
        if len(args) != 1 or kwargs or args[0] is not x or not torch.is_tensor(out):
            raise ValueError(f"{kind}: no final norm found: {type(base).__name__}'s forward applies {names} after its "
                             f"decoder layers, and {name} takes more than the previous one's output; the engine "
                             "applies one module, or a chain of them, between the last decoder layer and the head")
        x = out
    if not after:
        raise ValueError(f"{kind}: no final norm found: {type(base).__name__}'s forward applies no module after its "
                         "decoder layers, where the engine applies one (the final norm) before the head")
    modules = [getattr(base, n) for n in names]
    return modules[0] if len(modules) == 1 else FinalChain(modules)


def _logit_scale(model: nn.Module, config: object, kind: str) -> float | None:
    """The factor the wrapper's forward applies to its logits, or None for none.

    The same setting means opposite things across families (Granite divides by logits_scaling, HyperCLOVAX
    multiplies by it; MiniCPM3 divides the head's input, the same for a head without bias), so the operator is
    read from the wrapper's own source: `* self.logit_scale`, `/ self.config.logits_scaling`, ... Anything else
    is refused."""
    scale = None
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value in (None, 1.0, 1):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value == 0:
            raise ValueError(f"{kind}: {attr}={value!r} must be a non-zero number")
        ops = set(re.findall(rf"([*/])\s*self\.(?:config\.(?:text_config\.)?)?{attr}\b", _forward_source(model)))
        if len(ops) != 1 or scale is not None:
            raise ValueError(f"{kind} applies `{attr}` to its logits in a way the chunked head does not model (only "
                             "one scalar factor, `* self.{attr}` or `/ self.config.{attr}` in its forward)")
        scale = float(value) if ops == {"*"} else 1.0 / float(value)
    return scale


def _forward_source(model: nn.Module) -> str:
    try:
        return inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return ""


class _CaptureDone(Exception):
    pass


class HandedState:
    """Stands, in a layer's recorded inputs, for output `index` (> 0) of decoder layer `layer`: state the model's loop
    takes back from one layer and hands to the next (GLM-5's top-k indices selected by one layer's indexer and reused
    by the next). The engine puts the real value in its place as the layers run (engine/layer/handed_state.py)."""

    __slots__ = ("layer", "index")

    def __init__(self, layer: int, index: int) -> None:
        self.layer, self.index = layer, index

    def __repr__(self) -> str:
        return f"HandedState(layer={self.layer}, index={self.index})"


class _LayerOutput(tuple):
    """What a recorder hands the model's layer loop: usable both as the hidden state passed straight to the next
    layer (the next recorder unwraps it) and as a tuple the loop indexes (`hidden_states = outputs[0]`)."""


class LayerInputRecorder(nn.Module):
    """Stands in for decoder layer `index`: records the inputs the model hands it, passes the state on.

    The last recorder stops the model's forward so the final norm and anything after it never run.
    """

    def __init__(self, index: int, last: bool, original: nn.Module, sink: list, outputs: int = 1) -> None:
        super().__init__()
        self.index = index
        self.last = last
        self.sink = sink
        self.outputs = outputs  # how many values the loop takes back from each layer (the hidden state first)
        # Models pick per-layer masks from these attributes (e.g. Qwen2's sliding-window layers).
        for attr in ("attention_type", "layer_type", "is_sliding", "sliding_window", "block_type"):
            if hasattr(original, attr):
                setattr(self, attr, getattr(original, attr))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if isinstance(hidden_states, _LayerOutput):
            hidden_states = hidden_states[0]
        self.sink.append((hidden_states, args, kwargs))
        if self.last:
            raise _CaptureDone
        return _LayerOutput((hidden_states, *(HandedState(self.index, k) for k in range(1, self.outputs))))


def stands_in(stack: object) -> bool:
    """Whether a layer stack is the adapter's stand-ins (recorders, pass-throughs) for the real layers: the stack's
    forward is then the engine's own call, run as the model's own code."""
    return isinstance(stack, nn.ModuleList) and len(stack) > 0 and isinstance(stack[0], LayerInputRecorder | _PassThrough)


def _recorders(parts: DecoderParts, sink: list, outputs: int = 1) -> nn.ModuleList:
    n = len(parts.layers)
    return nn.ModuleList(LayerInputRecorder(i, i == n - 1, layer, sink, outputs)
                         for i, layer in enumerate(parts.layers))


# How many values a model's layer loop takes back from each layer, by stack (learned on its first recording).
_LOOP_OUTPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_OUTPUTS = 4


def embeds_tokens_again(parts: DecoderParts) -> bool:
    """Whether the stack holds an embedding besides the input embedding outside its layers (Gemma 3n's and Gemma
    4's per-layer input embeddings, learned positions): the stack is then run from the token ids, the input
    embedding's output replaced by the engine's, so what it looks up by token (or position) is its own lookup, not
    a reconstruction of the ids from the embedding output (Gemma 4 compares it with every row of the table)."""
    layers = {id(m) for m in parts.layers.modules()}
    return any(isinstance(m, nn.Embedding) and m is not parts.embed and id(m) not in layers
               for m in parts.base.modules())


def record_layer_inputs(parts: DecoderParts, sink: list, inputs_embeds: torch.Tensor,
                        attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                        input_ids: torch.Tensor | None = None):
    """Run the model's own forward up to the layers; return (layer-0 input, per-layer (args, kwargs)).

    The recorders stand in for the layer stack only while this runs: the user's model keeps its real
    decoder layers (and their weights) at every other moment, even when the forward raises. Inputs a layer takes
    besides its hidden state may depend on trained parameters (per-layer input embeddings): they come back with
    their graph (engine/layer/side_inputs.py carries their gradients back through it).
    """
    known = _LOOP_OUTPUTS.get(parts.base)
    failure: tuple[int, BaseException] | None = None
    for outputs in [known] if known else range(1, _MAX_OUTPUTS + 1):
        try:
            _run_stack(parts, sink, inputs_embeds, attention_mask, position_ids, input_ids, outputs)
        except (ValueError, TypeError, IndexError, AttributeError) as exc:
            if not sink:
                raise
            # The loop failed on what a layer handed back: it takes more than the hidden state from each layer.
            # The recorders then hand it stand-ins for more values (HandedState), up to _MAX_OUTPUTS.
            failure = failure or (len(sink) - 1, exc)
            continue
        _LOOP_OUTPUTS[parts.base] = outputs
        break
    else:
        at, exc = failure
        sink.clear()
        raise ValueError(f"{type(parts.model).__name__}'s layer loop takes more than the hidden state back from "
                         f"decoder layer {at} ({type(exc).__name__}: {exc}) in a way the engine cannot stand in for "
                         f"(up to {_MAX_OUTPUTS} values, each handed as it is to a later layer); train it with "
                         "another backend") from exc
    if len(sink) != len(parts.layers):
        raise RuntimeError(f"expected {len(parts.layers)} layer calls from {type(parts.base).__name__}.forward, "
                           f"saw {len(sink)}: the model's layer loop is not supported")
    h0 = sink[0][0]
    if h0.is_floating_point() and h0.dtype != inputs_embeds.dtype:
        # Model-level math with an FP32 buffer (XGLM's sinusoidal positions) turns bf16 embeddings into an FP32
        # layer input, which the bf16 layers cannot take (a bf16 model's buffers are bf16: the sum is bf16 too).
        h0 = h0.to(inputs_embeds.dtype)
    per_layer = [(args, {k: v for k, v in kw.items() if k not in ("cache", "past_key_values", "past_key_value")})
                 for _, args, kw in sink]
    sink.clear()
    return h0, per_layer


def _run_stack(parts: DecoderParts, sink: list, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None, input_ids: torch.Tensor | None, outputs: int) -> None:
    sink.clear()
    setattr(parts.base, parts.layers_attr, _recorders(parts, sink, outputs))
    from_ids = input_ids is not None and embeds_tokens_again(parts)
    hook = parts.embed.register_forward_hook(lambda m, a, out: inputs_embeds) if from_ids else None
    try:
        if from_ids:
            parts.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        else:
            parts.base(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False)
    except _CaptureDone:
        pass
    finally:
        setattr(parts.base, parts.layers_attr, parts.layers)
        if hook is not None:
            hook.remove()


def layer_structure_key(layer: nn.Module) -> tuple:
    """Two layers share a template iff this key is equal: class, parameter shapes, and plain settings."""
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
    settings = []
    for mname, mod in layer.named_modules():
        for k, v in sorted(vars(mod).items()):
            if k.startswith("_") or k in ("layer_idx", "training"):
                continue
            if isinstance(v, (bool, int, float, str, type(None), tuple)):
                settings.append((mname, k, v))
    return (type(layer).__qualname__, params, tuple(settings))
