"""Run the Hugging Face model's own forward (KV cache, generate, hidden states) with its layers streamed.

While the context is open, each decoder layer's weights are loaded into a device buffer by the same
pipeline that training uses (prefetching the next layers) just before the layer runs, and the layer's
parameters are pointed back at the host store's masters right after. HF's own layer code runs, so
whatever the model does (cache updates, sliding windows, returned attentions) is exactly the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..host.store import HostStore
from .schedule import LayerPipeline


def _point(layer: nn.Module, name: str, value: nn.Parameter) -> None:
    mod_name, _, leaf = name.rpartition(".")
    (layer.get_submodule(mod_name) if mod_name else layer)._parameters[leaf] = value


@contextlib.contextmanager
def streamed_layers(pipeline: LayerPipeline, store: HostStore, layers: nn.ModuleList) -> Iterator[None]:
    order = list(range(len(layers)))
    in_use: dict[int, int] = {}  # layer -> device buffer slot while the layer runs
    marks: dict[int, object] = {}

    def restore(i: int) -> None:
        group = store.layers[i]
        for slot, master in zip(group.slots, group.params):
            _point(layers[i], slot.name, master)
        pipeline.freed[in_use.pop(i)] = pipeline.streams.record_compute()

    def before(i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            slot = pipeline.acquire(order, i, "inference")
            group = store.layers[i]
            for s, view in zip(group.slots, group.views(pipeline.buffers[slot][: group.numel]).values()):
                _point(module, s.name, nn.Parameter(view, requires_grad=False))
            in_use[i] = slot
            marks[i] = pipeline.trace.mark()
        return hook

    def after(i: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            restore(i)
            pipeline.trace.add_since("compute", "infer", i, marks.pop(i))
        return hook

    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(before(i)))
            handles.append(layer.register_forward_hook(after(i)))
        yield
    finally:
        for h in handles:
            h.remove()
        for i in list(in_use):  # a layer that raised: its parameters go back to the masters all the same
            restore(i)
