"""Model placement: the user's model's weights moved into the host store, its parameters pointed at the
store's masters, the resident parameters (embedding, final norm, head) and the buffers placed on the device.

No second full copy of the model is ever alive: each tensor is copied into the store and the model's own
storage freed right away. The user's model object stays whole: state_dict, save_pretrained, parameters()
and submodules all read the weights the engine trains.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...config.schema import EngineConfig
from ...costs.modes import HostMaster
from ...models.adapter import DecoderParts
from ..host.loading import load_checkpoint_into
from ..host.node_store import NodeStore
from ..host.preflight import host_preflight, model_host_bytes
from ..host.resident_upload import ResidentUpload
from ..host.store import FlatGroup, HostStore
from ..layer import cpu_linear
from ..layer.router import router_recorder
from ..layer.templates import TemplateBank
from ..parallel.distributed import DataParallel
from ..runtime.device_resolution import resolve_device
from ..runtime.malloc import release_free_heap
from .peft_model import layer_adapters

__all__ = ["Placement", "place", "resolve_device"]  # resolve_device: the one device resolution (device_resolution.py)


def _set_param(root: nn.Module, name: str, value: nn.Parameter) -> None:
    mod_name, _, leaf = name.rpartition(".")
    root.get_submodule(mod_name)._parameters[leaf] = value


def _free(params: list[nn.Parameter]) -> None:
    # Drop the storage even if the caller still holds the Parameter objects (e.g. in an optimizer).
    for p in params:
        if p.device.type != "meta":
            p.data = torch.empty(0, dtype=p.dtype)


def _pack(group: FlatGroup, params: list[nn.Parameter]) -> list[nn.Parameter]:
    for slot, p in zip(group.slots, params):
        if p.device.type != "meta":
            group.write_slot(slot, p.detach())
    return params


@dataclass
class Placement:
    """Where the engine put the model's parameters: the store's masters, the resident ones' device copies,
    and each distinct parameter's name (tied weights under their first name, the others as aliases)."""

    parts: DecoderParts
    store: HostStore
    templates: TemplateBank
    device_globals: list[nn.Parameter]  # the resident parameters on the device, in the globals' slot order
    alias_globals: bool  # a CPU device computing in FP32: the device copies are the host masters themselves
    name_of: dict[int, str]  # id(the model's original Parameter) -> its name
    aliases: dict[str, str]  # tied weight's other name -> its first name
    embed_slot: int  # the embedding's index among the resident parameters (its gradient arrives as rows)
    upload: ResidentUpload | None = None  # CUDA in another dtype than the masters': pinned staging + copy stream

    def global_index(self, name: str) -> int:
        return next(i for i, s in enumerate(self.store.globals.slots) if s.name == name)

    def global_masters(self) -> list[tuple[str, nn.Parameter]]:
        """(HF name, FP32 master) of the resident parameters, tied ones under each of their names."""
        group = self.store.globals
        out = [(s.name, p) for s, p in zip(group.slots, group.params)]
        prefix = self.parts.layers_prefix + "."
        out += [(a, group.params[self.global_index(n)]) for a, n in self.aliases.items() if not a.startswith(prefix)]
        return out

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The FP32 master of every parameter; with host_master 'hilo' or 'bf16' the layers' values are FP32
        copies (the caller waits for queued updates first)."""
        named = self.store.named_parameters(self.parts.layers_prefix)
        if self.store.master_mode is HostMaster.FP32:
            return named
        values = {}
        for i, g in enumerate(self.store.layers):
            for s in g.slots:
                values[f"{self.parts.layers_prefix}.{i}.{s.name}"] = nn.Parameter(g.read_slot(s), requires_grad=False)
        return [(n, values.get(n, p)) for n, p in named]

    def layer_residents(self) -> list[list[tuple[str, int]]]:
        """Per layer, its resident parameters (PEFT's adapters, peft_model.layer_adapters): (name within the layer,
        index among the resident parameters). Empty lists for a model without any."""
        prefix = self.parts.layers_prefix + "."
        out: list[list[tuple[str, int]]] = [[] for _ in self.store.layers]
        for k, s in enumerate(self.store.globals.slots):
            if s.name.startswith(prefix):
                i, _, name = s.name[len(prefix):].partition(".")
                out[int(i)].append((name, k))
        return out

    def slots_by_name(self) -> dict[str, tuple]:
        out = {}
        for i, g in enumerate(self.store.layers):
            out.update({f"{self.parts.layers_prefix}.{i}.{s.name}": (g, s) for s in g.slots})
        out.update({s.name: (self.store.globals, s) for s in self.store.globals.slots})
        return out

    def globals_changed(self) -> None:
        """The resident masters changed: bring their device copies in line (queued, non-blocking)."""
        if self.upload is not None:
            self.upload.run()
        else:
            with torch.no_grad():
                for dev, master in zip(self.device_globals, self.store.globals.params):
                    if dev is not master:  # (aliased: the device copy is the master)
                        dev.copy_(master, non_blocking=True)

    def masters_changed(self) -> None:
        """Every master changed (a load, weights written by hand): refresh the streamed copies and the device's."""
        for g in self.store.layers:
            g.refresh_shadow()
        self.globals_changed()

    def stop_upload(self) -> None:
        """The resident parameters moved onto the device with the optimizer (update/resident.py): their compute copy is
        refreshed there from now on, so the host-to-device upload ends."""
        if self.upload is not None:
            self.upload.close()
            self.upload = None

    def fence_upload(self) -> None:
        """Before compute (or a read) that uses the resident parameters' device copies: the last upload, rounded
        on its worker, is ordered before it (resident_upload.py)."""
        if self.upload is not None:
            self.upload.fence()

    def take_device_writes(self) -> None:
        """A resident parameter written on the device (what the model object holds there) back into its master."""
        self.fence_upload()  # compare with what the last upload delivered, not with the values before it
        with torch.no_grad():
            for dev, master in zip(self.device_globals, self.store.globals.params):
                if dev is not master:
                    # (on the master's device: the host's, or the device's with the resident optimizer there)
                    if not torch.equal(dev.detach().to(master.device), master.detach().to(dev.dtype)):
                        master.copy_(dev.detach())


class UploadFence:
    """The embedding's forward pre-hook: the resident upload (rounded on its worker) ordered before the forward.
    It holds the placement weakly, and a copy or pickle of the model gets one that does nothing (a copy has
    weights of its own and no engine)."""

    def __init__(self, placed: Placement | None) -> None:
        self._placed = weakref.ref(placed) if placed is not None else None

    def __call__(self, module: nn.Module, args: tuple) -> None:
        placed = self._placed() if self._placed is not None else None
        if placed is not None:
            placed.fence_upload()

    def __deepcopy__(self, memo: dict) -> UploadFence:
        return UploadFence(None)

    def __reduce__(self) -> tuple:
        return UploadFence, (None,)


def loaded_bf16_frozen(parts: DecoderParts, frozen: frozenset[str] | set[str],
                       resident: frozenset[str] | set[str] = frozenset()) -> list[int]:
    """The layers none of whose streamed parameters trains, every one loaded in bf16: held as loaded, 2 bytes a
    parameter (host/codec.py LoadedBf16), where an FP32 master (and its shadow) would hold 4 (6) for weights that
    never change. `resident`: the layers' parameters held resident instead (PEFT's adapters), not in the layer's
    buffer. A layer from a checkpoint directory (meta until it is read) is not known to be bf16: it stays FP32."""
    prefix = parts.layers_prefix
    return [i for i, layer in enumerate(parts.layers)
            if all(f"{prefix}.{i}.{n}" in frozen and p.dtype == torch.bfloat16 and p.device.type != "meta"
                   for n, p in layer.named_parameters() if f"{prefix}.{i}.{n}" not in resident)]


def _held_as_loaded(item: tuple[str, nn.Parameter], frozen: frozenset[str] | set[str]) -> bool:
    """A resident parameter that never trains, loaded in bf16: held as loaded (host/codec.py FrozenTail), 2 bytes
    a parameter where an FP32 master would hold 4. Meta (from a checkpoint directory): not known to be bf16."""
    name, p = item
    return name in frozen and p.dtype == torch.bfloat16 and p.device.type != "meta"


def place(model: nn.Module, parts: DecoderParts, config: EngineConfig, device: torch.device,
          compute_dtype: torch.dtype, dp: DataParallel | None, node: NodeStore | None,
          checkpoint_dir: str | os.PathLike | None,
          probe: Callable[[nn.Module], object] | None,
          frozen: frozenset[str] | set[str] = frozenset()) -> tuple[Placement, list[nn.Parameter]]:
    """Move `model`'s weights into a new host store and place everything the step needs on `device`; also
    the model's own Parameters as handed in (keep them until the optimizer is adopted: `name_of` is by id).

    Refuses a model that cannot fit (host_preflight) before anything is allocated; `probe` (the parity probe)
    runs after that and before the store, so a model it refuses is left as it was. `frozen`: the parameters that do
    not train (trainable.py); the resident ones among them go last in their group, so its gradient slab can end
    before them.
    """
    pin = config.pin_memory if config.pin_memory is not None else device.type == "cuda"
    # Names: each distinct parameter once (tied weights under their first name), aliases kept.
    prefix = parts.layers_prefix + "."
    name_of: dict[int, str] = {}
    aliases: dict[str, str] = {}
    originals: list[nn.Parameter] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in name_of:
            aliases[name] = name_of[id(p)]
        else:
            name_of[id(p)] = name
            originals.append(p)
    # PEFT's adapters inside the layers are resident parameters too: the layers' buffers hold their base alone
    in_layers = layer_adapters(parts.layers, parts.layers_prefix)
    # stable: the trainable first, then the frozen ones, those loaded in bf16 last, each in model order
    global_named = sorted(((n, p) for n, p in model.named_parameters() if not n.startswith(prefix) or n in in_layers),
                          key=lambda item: (item[0] in frozen, _held_as_loaded(item, frozen)))

    def streamed(i: int, layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in layer.named_parameters() if f"{prefix}{i}.{n}" not in in_layers]

    layer_shapes = [[(n, p.shape) for n, p in streamed(i, layer)] for i, layer in enumerate(parts.layers)]

    host_preflight(layer_shapes, [p.shape for _, p in global_named], compute_dtype, pin=pin,
                   staging=device.type == "cuda", master=config.master_mode, grad=config.grad_slab,
                   freed=model_host_bytes(originals))
    if probe is not None:
        probe(model)
    store = HostStore(layer_shapes, [(n, p.shape) for n, p in global_named], pin,
                      torch.bfloat16 if compute_dtype == torch.bfloat16 else None,
                      config.master_mode, config.grad_slab, node,
                      # not with a node's shared store (its buffers are the mode's) or the NVMe tier (its records
                      # are sized by the store's mode)
                      loaded_bf16_frozen(parts, frozen, in_layers) if node is None and config.nvme_path is None else (),
                      # the frozen resident ones loaded in bf16, held so (not where the ranks move FP32 masters,
                      # nor under a checkpoint directory, which reads into FP32 masters: host/loading.py)
                      sum(p.numel() for n, p in global_named if _held_as_loaded((n, p), frozen))
                      if node is None and dp is None and checkpoint_dir is None else 0)
    if node is not None:
        node.make_staging(max(g.numel for g in store.layers))
    if config.bf16_rounding == "stochastic":
        for i, g in enumerate(store.layers):
            g.rounding = torch.Generator().manual_seed(0x5EED + i)  # one stream per layer: runs repeat exactly

    # MoE layers record their router logits; a CPU device computing in FP32 takes oneDNN's faster GEMMs
    templates = TemplateBank(router_recorder(parts.base), cpu_linear.for_device(device, compute_dtype))
    for i, layer in enumerate(parts.layers):
        templates.add(layer, device)
        group = store.layers[i]
        params = [p for _, p in streamed(i, layer)]
        if node is None or node.leader:  # a shared store: the node's first rank writes it
            _pack(group, params)
        _free(params)
        for slot, master in zip(group.slots, group.params):
            _set_param(layer, slot.name, master)
    _free(_pack(store.globals, [p for _, p in global_named]))
    release_free_heap()  # the model's freed weights, left resident in the C heap otherwise
    if checkpoint_dir is not None:
        load_checkpoint_into(store, Path(checkpoint_dir), parts.layers_prefix, aliases)
    if dp is not None:
        dp.check_same_model(store)
        dp.broadcast_masters(store)
    for g in store.layers:
        g.refresh_shadow()  # a shared store: each owner its layers'
    if node is not None:
        dp.node_barrier("waiting for the node's layer weights")

    # Resident parameters (embedding, final norm, head) live on the device for the whole step.
    alias_globals = device.type == "cpu" and compute_dtype == torch.float32
    device_globals: list[nn.Parameter] = []
    for slot, master in zip(store.globals.slots, store.globals.params):
        # (a weight held as loaded in bf16 is widened to its FP32 device copy: the same values)
        dev = (master if alias_globals and master.dtype == compute_dtype
               else nn.Parameter(master.detach().to(device, compute_dtype), requires_grad=True))
        device_globals.append(dev)
        _set_param(model, slot.name, dev)
    embed_slot = next(i for i, dev in enumerate(device_globals) if dev is parts.embed.weight)
    upload = (ResidentUpload(store, device_globals, compute_dtype, device, config.watchdog_s)
              if device.type == "cuda" and compute_dtype != torch.float32 else None)
    placed = Placement(parts, store, templates, device_globals, alias_globals, name_of, aliases, embed_slot, upload)
    if upload is not None:
        # Every forward (the engine's and the model's own) reads the embedding first: the upload is fenced there.
        parts.embed.register_forward_pre_hook(UploadFence(placed))
    for alias, name in aliases.items():
        if not alias.startswith(prefix):
            _set_param(model, alias, device_globals[placed.global_index(name)])
    # Buffers (rotary tables) go to the device; parameters are already placed. Not model.to(): that
    # would move the layers' host masters too.
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = b.to(device)
    return placed, originals
