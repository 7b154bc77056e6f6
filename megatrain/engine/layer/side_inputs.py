"""Layer inputs besides the hidden state that carry a gradient (Gemma 3n's and Gemma 4's per-layer input embeddings).

The model's own forward computes them once per micro-batch, before the layer loop, from trained parameters (a
per-layer embedding table, a projection of the input embedding): the recording (models/adapter.py) keeps that
graph. Each layer's forward and recompute take a detached leaf of its side inputs; the recompute (or a kept
layer's graph) differentiates with respect to those leaves too, their gradients are summed per input across the
layers that take it, and the engine's backward sends the sums through the recorded graph to the producer's
parameters and the embedding output, beside the hidden state's.
"""

from __future__ import annotations

import torch


class SideInputs:
    """Which of each layer's recorded inputs carry a gradient, the graph that produced them, their gradients."""

    def __init__(self, per_layer: list[tuple[tuple, dict]]) -> None:
        self.roots: list[torch.Tensor] = []  # the recorded inputs, with their producer's graph
        self._index: dict[int, int] = {}  # id(root) -> its position in roots (one input may feed several layers)
        self.where: list[list[tuple[int | str, int]]] = []  # per layer: (arg position or kwarg name, root)
        self.detached: list[tuple[tuple, dict]] = []  # the layer inputs with every side input detached
        for args, kwargs in per_layer:
            spots: list[tuple[int | str, int]] = []
            args = tuple(self._claim(v, k, spots) for k, v in enumerate(args))
            kwargs = {k: self._claim(v, k, spots) for k, v in kwargs.items()}
            self.where.append(spots)
            self.detached.append((args, kwargs))
        self.grads: list[torch.Tensor | None] = [None] * len(self.roots)

    def _claim(self, value: object, key: int | str, spots: list) -> object:
        if not (torch.is_tensor(value) and value.requires_grad):
            return value
        if id(value) not in self._index:
            self._index[id(value)] = len(self.roots)
            self.roots.append(value)
        spots.append((key, self._index[id(value)]))
        return value.detach()

    def __bool__(self) -> bool:
        return bool(self.roots)

    def of_layer(self, i: int) -> bool:
        return bool(self.where[i])

    def leaves(self, i: int, inputs: tuple[tuple, dict]) -> tuple[tuple[tuple, dict], list[torch.Tensor]]:
        """Layer i's inputs with fresh leaves (requiring grad) in place of its side inputs, and those leaves."""
        args, kwargs = inputs
        if not self.where[i]:
            return inputs, []
        args, kwargs = list(args), dict(kwargs)
        leaves = []
        for key, r in self.where[i]:
            leaf = self.roots[r].detach().requires_grad_(True)
            if isinstance(key, int):
                args[key] = leaf
            else:
                kwargs[key] = leaf
            leaves.append(leaf)
        return (tuple(args), kwargs), leaves

    def add_grads(self, i: int, grads: list[torch.Tensor | None]) -> None:
        """Sum layer i's side-input gradients (in `leaves(i)`'s order) into each input's total."""
        for (_, r), g in zip(self.where[i], grads):
            if g is None:
                continue
            self.grads[r] = g if self.grads[r] is None else self.grads[r] + g

    def backward_pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(recorded inputs, their summed gradients) for those a gradient reached; the gradients are then dropped."""
        pairs = [(r, g) for r, g in zip(self.roots, self.grads) if g is not None]
        self.grads = [None] * len(self.roots)
        return [r for r, _ in pairs], [g for _, g in pairs]
