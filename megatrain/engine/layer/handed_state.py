"""State handed between layers: what the model's loop takes back from one decoder layer besides the hidden state
and hands to a later one (GLM-5's DeepSeek-sparse-attention top-k indices, selected by one layer's indexer and
reused by the next).

The recording (models/adapter.py) leaves a `HandedState` stand-in in the inputs of the layer that takes such a
value. As the layers run forward, each stand-in is replaced by the value its layer returned, in the layer inputs
themselves: the recompute in backward then replays exactly the forward's value instead of depending on another
layer's recompute. That is exact for state that carries no gradient (integer indices); floating-point state would
carry one, and is refused by name.
"""

from __future__ import annotations

import torch

from ...models.adapter import HandedState


def _stand_ins(inputs: tuple[tuple, dict]) -> list[HandedState]:
    args, kwargs = inputs
    return [v for v in (*args, *kwargs.values()) if isinstance(v, HandedState)]


class HandedStates:
    """One forward's handed values: which layers' extra outputs are taken, and those outputs once computed."""

    def __init__(self, layer_inputs: list[tuple[tuple, dict]]) -> None:
        self.sources = {m.layer for inputs in layer_inputs for m in _stand_ins(inputs)}
        self._values: dict[int, tuple] = {}

    def __bool__(self) -> bool:
        return bool(self.sources)

    def keep(self, i: int, outputs: tuple) -> None:
        """Layer i's outputs besides the hidden state (TemplateBank.handed), when a later layer takes one."""
        if i in self.sources:
            self._values[i] = outputs

    def resolve(self, i: int, inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
        """Layer i's inputs with each stand-in replaced by the value it stands for."""
        if not _stand_ins(inputs):
            return inputs
        args, kwargs = inputs
        return tuple(self._value(i, v) for v in args), {k: self._value(i, v) for k, v in kwargs.items()}

    def _value(self, i: int, v: object) -> object:
        if not isinstance(v, HandedState):
            return v
        out = self._values.get(v.layer, ())
        if v.index - 1 >= len(out):
            raise RuntimeError(f"decoder layer {i} takes output {v.index} of layer {v.layer}, which returned "
                               f"{len(out) + 1} values")
        value = out[v.index - 1]
        if torch.is_tensor(value) and (value.is_floating_point() or value.is_complex()):
            raise ValueError(f"decoder layer {v.layer} hands layer {i} a floating-point state (its output {v.index}, "
                             f"shape {tuple(value.shape)}) besides the hidden state: it would carry a gradient from "
                             "one layer to the next, which the engine does not backpropagate (only state without "
                             "a gradient, such as selected indices, is replayed); train it with another backend")
        return value
