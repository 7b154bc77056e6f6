"""Stateless layer templates: one module per distinct layer structure, weights bound per call.

A template holds no weight storage (its parameters live on the `meta` device); each call binds
views of a device buffer with `torch.func.functional_call`, so running layer i costs no copy and
the number of templates does not grow with depth.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call

from ..models.adapter import layer_structure_key
from .tiling import tileable, tiled_forward


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
    def __init__(self) -> None:
        self._by_key: dict[tuple, nn.Module] = {}
        self.of_layer: list[nn.Module] = []
        self._tileable: dict[int, bool] = {}  # by id(template)

    def add(self, layer: nn.Module, device: torch.device) -> None:
        """Register decoder layer i (in order); the layer itself is left as it is."""
        key = layer_structure_key(layer)
        if key not in self._by_key:
            self._by_key[key] = _stateless_copy(layer, device)
            self._tileable[id(self._by_key[key])] = tileable(layer)
        self.of_layer.append(self._by_key[key])

    def tileable(self, i: int) -> bool:
        """Whether layer i's MLP can run over sequence tiles (see tiling.py)."""
        return self._tileable[id(self.of_layer[i])]

    def __len__(self) -> int:
        return len(self._by_key)

    def train(self, mode: bool) -> None:
        for t in self._by_key.values():
            t.train(mode)

    def call(self, i: int, weights: dict[str, torch.Tensor], hidden: torch.Tensor, args: tuple,
             kwargs: dict, tile: int | None = None) -> torch.Tensor:
        # Tiled only without autograd: under autograd the graph would keep every tile's activations
        # anyway (backward tiles through tiling.tiled_vjp instead).
        if tile is not None and not args and not torch.is_grad_enabled() and self.tileable(i):
            return tiled_forward(self.of_layer[i], weights, hidden, kwargs, tile)
        out = functional_call(self.of_layer[i], weights, (hidden, *args), kwargs, strict=False)
        return out[0] if isinstance(out, (tuple, list)) else out
