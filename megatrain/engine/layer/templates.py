"""Stateless layer templates: one module per distinct layer structure, weights bound per call.

A template holds no weight storage (its parameters live on the `meta` device); each call binds
views of a device buffer with `torch.func.functional_call`, so running layer i costs no copy and
the number of templates does not grow with depth.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
from torch import nn
from torch.func import functional_call

from ...models.adapter import layer_structure_key
from .cpu_linear import OneDnnLinears
from .router import router_modules
from .tiling import tileable, tiled_forward

# A PEFT adapter's switches (peft.tuners.tuners_utils.BaseTunerLayer, peft.utils.other.AuxiliaryTrainingWrapper):
# `disable_adapter()` and `set_adapter()` set them on the user's modules, so a template's copies, taken once, would
# keep running the adapters a reference pass (TRL's DPO over a PEFT model) switched off.
_ADAPTER_SWITCHES = ("_disable_adapters", "_active_adapter")


def _switched(template: nn.Module, layer: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(template's module, user's module) for each module of `layer` with adapter switches."""
    return [(t, u) for t, u in zip(template.modules(), layer.modules())
            if any(hasattr(u, k) for k in _ADAPTER_SWITCHES)]


def _from_peft(hook: object) -> bool:
    """Whether a hook is one of PEFT's (a partial of a function of its package): they live for one call."""
    fn = getattr(hook, "func", hook)
    return (getattr(fn, "__module__", None) or "").split(".")[0] == "peft"


def _take_call_hooks(template: nn.Module, user: nn.Module) -> None:
    """The forward pre-hooks PEFT puts on its adapter modules for the length of one PeftModel call (a mixed batch's
    `adapter_names`, aLoRA's `alora_offsets`) run on the template's module too. Not in training: backward recomputes
    each layer after that call has returned and PEFT has removed them, so the recompute would not be the forward
    (PEFT itself refuses `adapter_names` in training; aLoRA's offsets are what is refused here). A hook of the
    user's own stays registered: it runs in forward and recompute alike."""
    if user.training and any(_from_peft(h) for h in user._forward_pre_hooks.values()):
        raise ValueError(f"{type(user).__name__} has forward pre-hooks for this call (PEFT's alora_offsets or "
                         "adapter_names while training): MegaTrain recomputes each layer in backward, after PEFT has "
                         "removed them, so its gradients would not be this forward's; train without them (plain "
                         "LoRA), or use them in eval mode")
    template._forward_pre_hooks = user._forward_pre_hooks
    template._forward_pre_hooks_with_kwargs = user._forward_pre_hooks_with_kwargs


def _stateless_copy(layer: nn.Module, device: torch.device) -> nn.Module:
    # The copy gets meta parameters through deepcopy's memo, so no weight byte is duplicated, and the
    # user's layer stays untouched: it keeps serving its weights (the host store's masters).
    memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            for p in layer.parameters()}
    # Settings objects (the model config above all) stay shared: the engine switches the attention
    # implementation on the model's config, and the templates must follow it.
    for mod in layer.modules():
        for k, v in vars(mod).items():
            if not k.startswith("_") and not isinstance(v, (nn.Module, torch.Tensor)):
                memo[id(v)] = v
    template = copy.deepcopy(layer, memo)
    for mod in template.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.to(device)
    return template


class TemplateBank:
    """The templates, and for mixture-of-experts layers the router logits their calls produce.

    Router logits: while `recorded` is a dict, each call of layer i stores the logits its routers returned under
    i (the forward); a call of a layer in `router_grads` keeps them for `with_router_grads` (the recomputing
    backward), which pairs them with their gradients from the model's router loss (router.py).
    """

    def __init__(self, router_spec: object | None = None, linears: OneDnnLinears | None = None) -> None:
        self._by_key: dict[tuple, nn.Module] = {}
        self.of_layer: list[nn.Module] = []
        self._tileable: dict[int, bool] = {}  # by id(template)
        self.router_spec = router_spec
        self._routed: set[int] = set()  # ids of templates with router modules
        self._sink: list[torch.Tensor] | None = None
        self.recorded: dict[int, list[torch.Tensor]] | None = None
        self.router_grads: dict[int, list[torch.Tensor | None]] = {}
        self._recomputed: list[torch.Tensor] = []
        self.handed: tuple = ()  # the last call's outputs besides the hidden state (handed_state.py)
        # On a CPU device computing in FP32: each call's linears through oneDNN (cpu_linear.py for_device).
        self.linears = linears
        # Persistent buffers per layer (e.g. DeepSeek-V3's e_score_correction_bias): their values differ from
        # layer to layer, so each call binds the layer's own, read from the user's layer as it is at call time.
        self._buffers: list[list[tuple[str, nn.Module, str]]] = []
        # Per layer, its adapters' switches as the user's layer has them at call time (_ADAPTER_SWITCHES).
        self._switches: list[list[tuple[nn.Module, nn.Module]]] = []

    def add(self, layer: nn.Module, device: torch.device) -> None:
        """Register decoder layer i (in order); the layer itself is left as it is."""
        key = layer_structure_key(layer)
        if key not in self._by_key:
            template = self._by_key[key] = _stateless_copy(layer, device)
            routers = router_modules(template, self.router_spec) if self.router_spec is not None else []
            for mod, index in routers:
                mod.register_forward_hook(self._recorder(index))
            if routers:
                self._routed.add(id(template))
            # A routed MLP over sequence tiles would route each tile separately: its router logits come whole.
            self._tileable[id(template)] = tileable(layer) and not routers
        self.of_layer.append(self._by_key[key])
        self._switches.append(_switched(self._by_key[key], layer))
        self._buffers.append([(name, *_owner(layer, name)) for name, _ in layer.named_buffers()
                              if _persistent(layer, name)])

    def _recorder(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if self._sink is not None:
                self._sink.append(output[index] if isinstance(output, (tuple, list)) else output)
        return hook

    @property
    def routed(self) -> bool:
        """Whether any layer has router modules whose logits the model's loss may use."""
        return bool(self._routed)

    def tileable(self, i: int) -> bool:
        """Whether layer i's MLP can run over sequence tiles (see tiling.py)."""
        return self._tileable[id(self.of_layer[i])]

    def __len__(self) -> int:
        return len(self._by_key)

    def train(self, mode: bool) -> None:
        for t in self._by_key.values():
            t.train(mode)

    def kernels(self) -> OneDnnLinears | nullcontext:
        """The context every run of a layer's template computes in, forward, recompute and tiled backward alike (so
        a recompute has its forward's bits): the CPU linears where the engine set them."""
        return self.linears if self.linears is not None else nullcontext()

    def call(self, i: int, weights: dict[str, torch.Tensor], hidden: torch.Tensor, args: tuple,
             kwargs: dict, tile: int | None = None) -> torch.Tensor:
        # Tiled only without autograd: under autograd the graph would keep every tile's activations
        # anyway (backward tiles through tiling.tiled_vjp instead).
        self.handed = ()
        for t, u in self._switches[i]:  # one template serves several layers: each call takes its layer's
            for k in _ADAPTER_SWITCHES:
                if hasattr(u, k):
                    setattr(t, k, getattr(u, k))
            _take_call_hooks(t, u)
        if tile is not None and not args and not torch.is_grad_enabled() and self.tileable(i):
            with self.kernels():
                return tiled_forward(self.of_layer[i], weights, hidden, kwargs, tile)
        if self._buffers[i]:
            weights = {**{n: mod._buffers[leaf] for n, mod, leaf in self._buffers[i]}, **weights}
        record = id(self.of_layer[i]) in self._routed and (self.recorded is not None or i in self.router_grads)
        self._sink = [] if record else None
        try:
            with self.kernels():
                out = functional_call(self.of_layer[i], weights, (hidden, *args), kwargs, strict=False)
        finally:
            captured, self._sink = self._sink, None
        if record and self.recorded is not None:
            self.recorded[i] = captured
        elif record:
            self._recomputed = captured
        if isinstance(out, (tuple, list)):
            self.handed = tuple(out[1:])
            return out[0]
        return out

    def with_router_grads(self, i: int, y: torch.Tensor, g: torch.Tensor,
                          logits: list[torch.Tensor] | None = None) -> tuple[tuple, tuple]:
        """The outputs of layer i's call and their gradients: (y, *router logits), (g, *their grads). `logits`: the
        router logits of the call whose graph backpropagates (a kept forward's); None: the recompute's."""
        grads = self.router_grads.pop(i, None)
        if logits is None:
            logits, self._recomputed = self._recomputed, []
        if not grads:
            return (y,), (g,)
        if len(grads) != len(logits):
            raise RuntimeError(f"layer {i}: its recompute produced {len(logits)} router logits, its forward "
                               f"{len(grads)}")
        pairs = [(z, gz) for z, gz in zip(logits, grads) if gz is not None]
        return (y, *(z for z, _ in pairs)), (g, *(gz for _, gz in pairs))


def _owner(layer: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_name, _, leaf = name.rpartition(".")
    return (layer.get_submodule(mod_name) if mod_name else layer), leaf


def _persistent(layer: nn.Module, name: str) -> bool:
    mod, leaf = _owner(layer, name)
    return leaf not in mod._non_persistent_buffers_set
