"""PEFT's adapters inside the decoder layers, held as resident parameters (placement.py, peft_model.layer_adapters).

Each layer's streamed buffer then holds its base weights alone: under LoRA a wholly frozen buffer (held as loaded
where the base is bf16, no gradient slab, nothing sent back, no host update), while the adapters' weights,
gradients and Adam state sit with the embedding's and head's on the device. Each call of a layer binds its
adapters' device tensors beside its buffer's views; its backward (recompute or kept graph) differentiates with
respect to them too, and their gradients stay on the device until the layers' backward ends, then go into the
resident parameters' slab in one add (pipeline/global_grads.py), where the clip norm and the non-finite check read
them with the rest. A layer's base gradients, where it has any, leave as before.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..pipeline.global_grads import GlobalGradSink
from ..pipeline.schedule import LayerPipeline


# What is read of placement.py's Placement and trainable.py's Trainable (not imported: placement.py finds the adapters
# through peft_model.py, which hands the engine attach_adapters).
class Placed(Protocol):
    device_globals: list[torch.nn.Parameter]

    def layer_residents(self) -> list[list[tuple[str, int]]]: ...


class Trains(Protocol):
    globals: list[bool]  # per resident parameter: whether it trains


class LayerAdapters:
    """Which resident parameters each layer reads, their values and leaves per call, their gradients until sent."""

    def __init__(self, residents: list[list[tuple[str, int]]], device_globals: list[torch.nn.Parameter],
                 trainable: Trains, sink: GlobalGradSink) -> None:
        self.of_layer = residents  # per layer: (name within the layer, index among the resident parameters)
        self.device_globals = device_globals
        self.trainable = trainable
        self.sink = sink
        self._pending: list[tuple[int, torch.Tensor]] = []  # (resident index, gradient on the device)

    def values(self, i: int, given: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer i's adapters not in `given`, as the device holds them (a forward: no gradient)."""
        return {n: self.device_globals[k].detach() for n, k in self.of_layer[i] if n not in given}

    def leaves(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's adapters as autograd leaves; one that does not train requires no gradient."""
        return {n: self.device_globals[k].detach().requires_grad_(self.trainable.globals[k])
                for n, k in self.of_layer[i]}

    def take(self, i: int, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Layer i's weight gradients (its buffer's, then its adapters', as `leaves` put them): the adapters' kept
        until `flush`, the buffer's returned."""
        n = len(grads) - len(self.of_layer[i])
        self._pending += [(k, g) for (_, k), g in zip(self.of_layer[i], grads[n:]) if g is not None]
        return grads[:n]

    def flush(self) -> None:
        """The gradients taken since the last flush into the resident parameters' slab."""
        grads: list[torch.Tensor | None] = [None] * len(self.device_globals)
        for k, g in self._pending:
            grads[k] = g if grads[k] is None else grads[k] + g
        self._pending = []
        self.sink.add_dense(grads)

    def drop(self) -> None:
        self._pending = []


class AdapterPipeline(LayerPipeline):
    """The layer pipeline of a model with resident adapters in its layers (see the module docstring)."""

    adapters: LayerAdapters

    def _leaves(self, i: int, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**super()._leaves(i, views), **self.adapters.leaves(i)}

    def _call(self, i: int, weights: dict[str, torch.Tensor], x: torch.Tensor, inputs: tuple[tuple, dict],
              handed, tile: int | None = None) -> torch.Tensor:
        extra = self.adapters.values(i, weights)
        return super()._call(i, {**weights, **extra} if extra else weights, x, inputs, handed, tile)

    def _layer_backward(self, i: int, *args, **kwargs):
        gx, gw, done = super()._layer_backward(i, *args, **kwargs)
        return gx, self.adapters.take(i, gw), done

    def _kept_backward(self, i: int, *args, **kwargs):
        gx, gw, done = super()._kept_backward(i, *args, **kwargs)
        return gx, self.adapters.take(i, gw), done

    def backward(self, *args, ceiling: int | None = None, **kwargs) -> torch.Tensor | None:
        if ceiling is None:  # a backward of its own: nothing is left of one abandoned before it
            self.adapters.drop()
        try:
            g = super().backward(*args, ceiling=ceiling, **kwargs)
        except torch.OutOfMemoryError:
            raise  # kept: the backward goes on from the layer that failed (runtime/oom.py layers_backward)
        except BaseException:
            self.adapters.drop()
            raise
        self.adapters.flush()
        return g


def attach_adapters(pipeline: LayerPipeline, placement: Placed, sink: GlobalGradSink) -> None:
    """Where the model's layers read resident parameters (PEFT's adapters), the pipeline binds them and returns
    their gradients into `sink` (the resident parameters' slab); otherwise it is left as it is. (The pipeline
    object stays the one the engine's other parts hold: its class becomes AdapterPipeline.)"""
    residents = placement.layer_residents()
    if not any(residents):
        return
    pipeline.__class__ = AdapterPipeline
    pipeline.adapters = LayerAdapters(residents, placement.device_globals, pipeline.trainable, sink)
