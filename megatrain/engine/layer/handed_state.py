"""State handed between layers: what the model's loop takes back from one decoder layer besides the hidden state
and hands to a later one (GLM-5's DeepSeek-sparse-attention top-k indices, selected by one layer's indexer and
reused by the next).

The recording (models/adapter.py) leaves a `HandedState` stand-in in the inputs of the layer that takes such a
value. As the layers run forward, each stand-in is replaced by the value its layer returned, in the layer inputs
themselves: the recompute in backward then replays exactly the forward's value instead of depending on another
layer's recompute. That is exact for state that carries no gradient (integer indices). Floating-point state carries
one (Zaya's router states): it travels packed with the hidden state into the next layer (`pack`, `unpack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.adapter import HandedState


def _stand_ins(inputs: tuple[tuple, dict]) -> list[HandedState]:
    args, kwargs = inputs
    return [v for v in (*args, *kwargs.values()) if isinstance(v, HandedState)]


@dataclass(frozen=True)
class _Carry:
    """A floating-point state layer `source[0]` hands the next layer (its output `source[1]`), carried with the
    hidden state as one tensor: `cat([hidden, state], -1)` in their promoted dtype, split again by the next layer."""

    source: tuple[int, int]
    hidden_width: int
    hidden_dtype: torch.dtype
    state_dtype: torch.dtype


class HandedStates:
    """One forward's handed values: which layers' extra outputs are taken, and those outputs once computed.

    State without a gradient (integer indices) is replayed: its value is put in the taking layer's inputs. A
    floating-point state would carry a gradient (Zaya's router states): it is carried like the hidden state, packed
    with it into one tensor from the layer that returns it to the next, so the activations, the kept graphs and the
    recompute's input gradient carry it and its gradient as they carry the hidden state's."""

    def __init__(self, layer_inputs: list[tuple[tuple, dict]]) -> None:
        self.consumers: dict[tuple[int, int], list[int]] = {}
        for i, inputs in enumerate(layer_inputs):
            for m in _stand_ins(inputs):
                self.consumers.setdefault((m.layer, m.index), []).append(i)
        self.sources = {j for j, _ in self.consumers}
        self.takers = {i for users in self.consumers.values() for i in users}
        self._values: dict[int, tuple] = {}
        self.carried: dict[int, _Carry] = {}  # by the taking layer, learned from the forward's values

    def __bool__(self) -> bool:
        return bool(self.sources)

    def touches(self, i: int) -> bool:
        """Whether layer i hands or takes state (it then runs whole: a sequence tile would see part of it)."""
        return i in self.sources or i in self.takers

    def keep(self, i: int, outputs: tuple) -> None:
        """Layer i's outputs besides the hidden state (TemplateBank.handed), when a later layer takes one."""
        if i in self.sources:
            self._values[i] = outputs

    def pack(self, i: int, hidden: torch.Tensor, outputs: tuple) -> torch.Tensor:
        """Layer i's output as the layer loop carries it: the hidden state, packed with the floating-point state it
        hands the next layer if any (decided on the forward's values, kept for the recompute)."""
        if i not in self.sources:
            return hidden
        self.keep(i, outputs)
        carry = self.carried.get(i + 1)
        if carry is None:
            for (j, k), users in self.consumers.items():
                value = outputs[k - 1] if j == i and k - 1 < len(outputs) else None
                if not (torch.is_tensor(value) and value.is_floating_point()):
                    continue
                if users != [i + 1] or value.shape[:-1] != hidden.shape[:-1] or carry is not None:
                    raise ValueError(f"decoder layer {i} hands layers {users} a floating-point state (its output {k}, "
                                     f"shape {tuple(value.shape)}) besides the hidden state: it carries a gradient, "
                                     "and the engine carries one such state per layer, to the next layer only, with "
                                     "the hidden state's leading dims; train it with another backend")
                carry = self.carried[i + 1] = _Carry((j, k), hidden.shape[-1], hidden.dtype, value.dtype)
        if carry is None:
            return hidden
        value = outputs[carry.source[1] - 1]
        dtype = torch.promote_types(hidden.dtype, value.dtype)
        return torch.cat([hidden.to(dtype), value.to(dtype)], dim=-1)

    def unpack(self, i: int, x: torch.Tensor,
               inputs: tuple[tuple, dict]) -> tuple[torch.Tensor, tuple[tuple, dict]]:
        """Layer i's hidden state and inputs from what the loop carries into it (the inverse of `pack`)."""
        carry = self.carried.get(i)
        if carry is None:
            return x, inputs
        hidden = x[..., : carry.hidden_width].to(carry.hidden_dtype)
        state = x[..., carry.hidden_width:].to(carry.state_dtype)

        def put(v: object) -> object:
            return state if isinstance(v, HandedState) and (v.layer, v.index) == carry.source else v

        args, kwargs = inputs
        return hidden, (tuple(put(v) for v in args), {k: put(v) for k, v in kwargs.items()})

    def resolve(self, i: int, inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
        """Layer i's inputs with each replayed stand-in replaced by the value it stands for (a carried state's
        stand-in stays: `unpack` fills it from the carried tensor)."""
        if not _stand_ins(inputs):
            return inputs
        args, kwargs = inputs
        return tuple(self._value(i, v) for v in args), {k: self._value(i, v) for k, v in kwargs.items()}

    def _value(self, i: int, v: object) -> object:
        if not isinstance(v, HandedState):
            return v
        carry = self.carried.get(i)
        if carry is not None and (v.layer, v.index) == carry.source:
            return v
        out = self._values.get(v.layer, ())
        if v.index - 1 >= len(out):
            raise RuntimeError(f"decoder layer {i} takes output {v.index} of layer {v.layer}, which returned "
                               f"{len(out) + 1} values")
        value = out[v.index - 1]
        if torch.is_tensor(value) and (value.is_floating_point() or value.is_complex()):
            raise ValueError(f"decoder layer {v.layer} hands layer {i} a floating-point state (its output {v.index}, "
                             f"shape {tuple(value.shape)}) besides the hidden state that is not carried to it; train "
                             "it with another backend")
        return value
