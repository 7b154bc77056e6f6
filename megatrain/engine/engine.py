"""The engine: composes the host store, templates, streams and pipeline into forward / backward / step.

The model it is given stays the user's whole model object: its parameters become the store's masters
and its forward is routed here (model_object.py).
"""

from __future__ import annotations

import math
import os
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..config import EngineConfig
from ..models.adapter import DecoderParts, find_parts, record_layer_inputs
from ..modes import GradSlab, HostMaster
from .activations import ActivationStore
from .attention import use_segment_attention
from .batch import check_batch
from .distributed import DataParallel
from .embedding import check_embedding, lookup_grad
from .global_grads import GlobalGradSink
from .loading import load_checkpoint_into, skeleton_from_dir
from .loss import chunked_causal_lm_loss, head_logits
from .malloc import set_mmap_threshold
from .memtrack import DeviceMemoryTracker
from .model_object import bind as bind_model_object
from .node_store import shard_optimizer_state
from .optim import LayeredStep, unsupported_reason
from .preflight import host_preflight
from .probe import verify_model
from .schedule import LayerPipeline
from .store import HostStore
from .stream import Event, Streams, Trace
from .templates import TemplateBank
from .tiling import long_context_policy

_live_engines: weakref.WeakSet = weakref.WeakSet()


def engines_holding(tensors: list[torch.Tensor]) -> list[Engine]:
    """The live engines whose model object holds any of `tensors` as a parameter."""
    ids = {id(t) for t in tensors}
    # The class's named_parameters: the handles the model holds (the model object's override may serve copies)
    return [e for e in list(_live_engines)
            if any(id(p) in ids for _, p in type(e.module).named_parameters(e.module))]


OptimizerArg = torch.optim.Optimizer | Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer] | None


def resolve_device(name: str | None) -> torch.device:
    if name is not None:
        # Refused here, before the engine takes the model: torch would only fail later, mid-construction.
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={name!r} is not a torch device such as 'cuda', 'cuda:0' or 'cpu' ({e})") from e
        backend = getattr(torch, dev.type, None)
        if dev.type == "meta" or (dev.type != "cpu" and not (hasattr(backend, "is_available")
                                                            and backend.is_available())):
            raise ValueError(f"device={name!r}: no such device is available to torch here; use 'cpu' or leave "
                             "it unset to use the accelerator when there is one")
        if dev.index is not None and hasattr(backend, "device_count") and dev.index >= backend.device_count():
            raise ValueError(f"device={name!r}: only {backend.device_count()} {dev.type} device(s) present")
        return dev
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return acc or torch.device("cpu")


def _set_param(root: nn.Module, name: str, value: nn.Parameter) -> None:
    mod_name, _, leaf = name.rpartition(".")
    root.get_submodule(mod_name)._parameters[leaf] = value


def _free(params: list[nn.Parameter]) -> None:
    # Drop the storage even if the caller still holds the Parameter objects (e.g. in an optimizer).
    for p in params:
        if p.device.type != "meta":
            p.data = torch.empty(0, dtype=p.dtype)


@dataclass
class _Pending:
    """What backward needs from the forward it follows."""

    h0: torch.Tensor  # embedding output, a leaf
    h_in0: torch.Tensor  # layer-0 input: h0 after any model-level math (scales, position embeddings)
    h_last: torch.Tensor  # last layer's output, a leaf the head was computed from
    layer_inputs: list
    acts: ActivationStore
    ids: torch.Tensor


class Engine:
    """Train a Hugging Face decoder-only LM whose weights and optimizer state live in host memory."""

    def __init__(self, model: nn.Module | str | os.PathLike, config: EngineConfig | None = None,
                 optimizer: OptimizerArg = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)
        # Launched as one of several ranks (torchrun & co.): join the job before touching the model; on a GPU
        # with no index named, this rank takes its node's device LOCAL_RANK.
        self.dp = DataParallel.from_env(self.device, config.watchdog_s)
        if self.dp is not None and self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", self.dp.local_rank)
            torch.cuda.set_device(self.device)  # the streams' waits act on the current device's stream
        self.trace_log = Trace(config.trace, self.device)
        if self.dp is not None:
            self.dp.stream.trace = self.dp.updates.trace = self.trace_log
        # Several ranks on a node: one host store for all of them (engine/node_store.py), unless configured off.
        self.node = self.dp.share_host_store() if self.dp is not None and config.share_host_store else None
        self.compute_dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else torch.float32
        if config.host_mmap_threshold_bytes is not None:
            set_mmap_threshold(config.host_mmap_threshold_bytes)  # before the model's weights are freed
        checkpoint_dir = None
        if isinstance(model, (str, os.PathLike)):
            checkpoint_dir = Path(model)
            model = skeleton_from_dir(checkpoint_dir)
        parts = find_parts(model)
        check_embedding(parts.embed)
        self.parts: DecoderParts = parts
        self.module = model
        self.hf_config = model.config
        pin = config.pin_memory if config.pin_memory is not None else self.device.type == "cuda"
        self._alias_globals = self.device.type == "cpu" and self.compute_dtype == torch.float32

        # Names: each distinct parameter once (tied weights under their first name), aliases kept.
        prefix = parts.layers_prefix + "."
        self._name_of: dict[int, str] = {}
        self._aliases: dict[str, str] = {}
        originals: list[nn.Parameter] = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in self._name_of:
                self._aliases[name] = self._name_of[id(p)]
            else:
                self._name_of[id(p)] = name
                originals.append(p)
        global_named = [(n, p) for n, p in model.named_parameters() if not n.startswith(prefix)]
        layer_shapes = [[(n, p.shape) for n, p in layer.named_parameters()] for layer in parts.layers]

        host_preflight(layer_shapes, [p.shape for _, p in global_named], self.compute_dtype, pin=pin,
                       staging=self.device.type == "cuda", master=config.master_mode, grad=config.grad_slab)
        if config.parity_probe:
            # After the preflight (a model that cannot fit is refused without the probe's seconds), before the
            # store: a model the probe refuses is left as it was.
            verify_model(model, type(self))
        self.store = HostStore(layer_shapes, [(n, p.shape) for n, p in global_named], pin,
                               torch.bfloat16 if self.compute_dtype == torch.bfloat16 else None,
                               config.master_mode, config.grad_slab, self.node)
        if self.node is not None:
            self.node.make_staging(max(g.numel for g in self.store.layers))
        if config.bf16_rounding == "stochastic":
            for i, g in enumerate(self.store.layers):
                g.rounding = torch.Generator().manual_seed(0x5EED + i)  # one stream per layer: runs repeat exactly

        # Pack: copy each tensor into the store, free the model's own storage right away (no second full
        # copy of the model is ever alive) and point the model's parameters at the store's masters, so the
        # user's model object stays whole: state_dict, save_pretrained, parameters() and submodules all
        # read the weights the engine trains.
        self.templates = TemplateBank()
        for i, layer in enumerate(parts.layers):
            self.templates.add(layer, self.device)
            group = self.store.layers[i]
            params = [p for _, p in layer.named_parameters()]
            if self.node is None or self.node.leader:  # a shared store: the node's first rank writes it
                self._pack(group, params)
            _free(params)
            for slot, master in zip(group.slots, group.params):
                _set_param(layer, slot.name, master)
        _free(self._pack(self.store.globals, [p for _, p in global_named]))
        if checkpoint_dir is not None:
            load_checkpoint_into(self.store, checkpoint_dir, parts.layers_prefix, self._aliases)
        if self.dp is not None:
            self.dp.check_same_model(self.store)
            self.dp.broadcast_masters(self.store)
        for g in self.store.layers:
            g.refresh_shadow()  # a shared store: each owner its layers'
        if self.node is not None:
            self.dp.node_barrier("waiting for the node's layer weights")
        self._recorded: list = []

        # Resident parameters (embedding, final norm, head) live on the device for the whole step.
        self._device_globals: list[nn.Parameter] = []
        for slot, master in zip(self.store.globals.slots, self.store.globals.params):
            if self._alias_globals:
                dev = master
            else:
                dev = nn.Parameter(master.detach().to(self.device, self.compute_dtype), requires_grad=True)
            self._device_globals.append(dev)
            _set_param(model, slot.name, dev)
        self._embed_slot = next(i for i, dev in enumerate(self._device_globals) if dev is self.parts.embed.weight)
        for alias, name in self._aliases.items():
            if not alias.startswith(prefix):
                _set_param(model, alias, self._device_globals[self._global_index(name)])
        # Buffers (rotary tables) go to the device; parameters are already placed. Not model.to(): that
        # would move the layers' host masters too.
        for mod in model.modules():
            for name, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[name] = b.to(self.device)

        self.streams = Streams(self.device, self.trace_log, config.link_gbps, config.watchdog_s)
        # Long context (issue 7): attention without an O(tokens²) mask, per-batch MLP tiling and activation
        # offload (tiling.py), and on a CPU "device" optionally the measured live bytes of the step.
        self.hf_attention = self.hf_config._attn_implementation  # the model's own, for its own forward (generate)
        self.segment_attention = use_segment_attention(self.hf_config, config.segment_attention)
        policy = long_context_policy(config, self.templates.of_layer, [g.numel for g in self.store.layers], config.num_buffers,
                                     self.device, self.compute_dtype,
                                     sum(p.numel() * p.element_size() for p in self._device_globals),
                                     self.parts.lm_head.weight.shape)
        self.memory = DeviceMemoryTracker(self.device) if config.measure_device_memory else None
        if self.memory is not None:
            self.forward, self.backward = self.memory.wrap(self.forward), self.memory.wrap(self.backward)
        self.pipeline = LayerPipeline(self.store, self.templates, self.streams, self.trace_log, config.num_buffers,
                                      self.compute_dtype, self.device, preserve_rng=self._has_dropout(),
                                      policy=policy)
        self._global_grads = GlobalGradSink(self.store, self.streams, self.pipeline, self.compute_dtype)
        self.optimizer = self._make_optimizer(optimizer, originals)
        if self.node is not None:
            foreign = {id(p) for g in self.store.layers if not g.owned for p in g.params}
            shard_optimizer_state(self.optimizer, foreign, self.dp.group, self.synchronize)
        del originals
        self._layered: LayeredStep | None = None
        self._in_backward = config.optimizer_in_backward
        layer_wise = self.store.per_layer_update or self._in_backward
        if config.optimizer_overlap or layer_wise:
            reason = unsupported_reason(self.optimizer)
            if reason is not None and layer_wise:
                # No whole-model FP32 master or gradient to step at once: a layer at a time or not at all.
                raise ValueError(f"host_master={config.host_master!r}, host_grad_dtype={config.host_grad_dtype!r}, "
                                 f"optimizer_in_backward={config.optimizer_in_backward} update one layer at a time, "
                                 f"which needs torch's Adam or AdamW: {reason}; use the default modes for it")
            if reason is not None:
                warnings.warn(f"optimizer_overlap: {reason}, so it steps whole after backward", stacklevel=2)
            else:
                self._layered = LayeredStep(self.optimizer, self.store, self.trace_log, config.watchdog_s)
                self.pipeline.updated, self.pipeline.zeroed = self._layered.updated, self._layered.zeroed
        if self._in_backward:
            self.pipeline.grad_sink = self._update_in_backward
        if self.node is not None:
            self.pipeline.grad_sink = self._reduce_to_owner
        self._clip_coefs: list[float] = []  # clipping not yet applied to bf16 slabs (applied as they widen)
        self._backwards = 0  # backward() calls since zero_grad()
        self._unstepped = False  # optimizer in backward: layers updated by a backward whose step() is to come
        self._failed_layer: int | None = None  # optimizer in backward: the layer whose gradient was not finite
        self._pending: _Pending | None = None
        self._unbackwarded: list[weakref.ref] = []  # training forwards replaced before their backward
        self._autograd_running = False  # inside backward()'s autograd call (loss.backward() is refused)
        self._stray_backward = False  # a refused loss.backward() may have left head/norm gradients behind
        self._norm: float | None = None  # cached gradient norm, valid until grads change
        self._unaveraged = False  # data parallel: a backward(sync=False) added gradients not yet averaged
        self.skipped_steps = 0
        self._bad_in_a_row = 0
        bind_model_object(self)
        self.train()
        _live_engines.add(self)
        self.reset_stats()

    # -- setup helpers ----------------------------------------------------------------------------
    @staticmethod
    def _pack(group, params: list[nn.Parameter]) -> list[nn.Parameter]:
        for slot, p in zip(group.slots, params):
            if p.device.type != "meta":
                group.write_slot(slot, p.detach())
        return params

    def _global_index(self, name: str) -> int:
        return next(i for i, s in enumerate(self.store.globals.slots) if s.name == name)

    def _has_dropout(self) -> bool:
        cfg = self.hf_config
        return any((getattr(cfg, k, 0) or 0) > 0 for k in ("attention_dropout", "hidden_dropout", "dropout",
                                                             "resid_pdrop", "attn_pdrop"))

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The FP32 master of every parameter. With host_master 'hilo' or 'bf16' the layers' values are FP32
        copies made on each call (read-only: write weights with load_state_dict)."""
        named = self.store.named_parameters(self.parts.layers_prefix)
        if self.store.master_mode is HostMaster.FP32:
            return named
        self.synchronize()
        values = {}
        for i, g in enumerate(self.store.layers):
            for s in g.slots:
                values[f"{self.parts.layers_prefix}.{i}.{s.name}"] = nn.Parameter(g.read_slot(s), requires_grad=False)
        return [(n, values.get(n, p)) for n, p in named]

    def _slots_by_name(self) -> dict[str, tuple]:
        out = {}
        for i, g in enumerate(self.store.layers):
            out.update({f"{self.parts.layers_prefix}.{i}.{s.name}": (g, s) for s in g.slots})
        out.update({s.name: (self.store.globals, s) for s in self.store.globals.slots})
        return out

    def global_masters(self) -> list[tuple[str, nn.Parameter]]:
        """(HF name, FP32 master) of the resident parameters, tied ones under each of their names."""
        group = self.store.globals
        out = [(s.name, p) for s, p in zip(group.slots, group.params)]
        prefix = self.parts.layers_prefix + "."
        out += [(a, group.params[self._global_index(n)]) for a, n in self._aliases.items() if not a.startswith(prefix)]
        return out

    def params_written(self, src: int | None = None) -> None:
        """Weights were written by hand through the model object: bring every copy the engine keeps in line.

        Data parallel: `src` is the rank that wrote (GatheredParameters' modifier_rank); every rank calls this
        and takes that rank's weights, so no rank trains on from weights the others do not have.

        A resident parameter written on the device (its copy there is what the model object holds when
        the engine does not compute in FP32 on the CPU) is copied back into its master first.
        """
        if self.store.master_mode is not HostMaster.FP32:
            raise RuntimeError(f"host_master={self.config.host_master!r}: the decoder layers' parameters on the model "
                               "object are a shared scratch, not the masters, so writes through them are lost; read "
                               "weights with engine.state_dict() and write them with engine.load_state_dict()")
        self.synchronize()
        if not self._alias_globals:
            with torch.no_grad():
                for dev, master in zip(self._device_globals, self.store.globals.params):
                    if not torch.equal(dev.detach().cpu(), master.detach().to(dev.dtype)):
                        master.copy_(dev.detach())
        if self.dp is not None and src is not None:
            self.dp.broadcast_from(self.store, src)  # only `src` wrote: the other ranks take its weights
        self._masters_changed()
        if self.node is not None:
            self.dp.node_barrier("waiting for the owners' refreshed layers")

    def _make_optimizer(self, optimizer: OptimizerArg, originals: list[nn.Parameter]) -> torch.optim.Optimizer:
        named = self.store.named_parameters(self.parts.layers_prefix)  # the handles the optimizer updates
        if optimizer is None:
            # The masters are host tensors whatever the compute device: torch's fused CPU kernel is ~10x
            # its per-tensor loop, which it would pick for CPU tensors when left to choose.
            return torch.optim.AdamW([p for _, p in named], fused=True)
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            return optimizer(named)
        # Take over the user's optimizer: same object, same hyper-parameters, now over the host masters,
        # so LR schedulers built on it keep working.
        by_name = dict(named)
        by_name.update({a: by_name[n] for a, n in self._aliases.items() if n in by_name})
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                name = self._name_of.get(id(p))
                if name is None:
                    raise ValueError("the optimizer holds a parameter that is not part of the model; build it "
                                     "over model.parameters() before handing both to MegaTrain")
                new.append(by_name[name])
            group["params"] = new
            if (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and group.get("fused") is None
                    and group.get("foreach") is None and not group.get("differentiable")):
                group["fused"] = True  # same math; the user chose no kernel, and the default one is ~10x slower here
        optimizer.state = defaultdict(dict)
        return optimizer

    # -- modes ------------------------------------------------------------------------------------
    @property
    def training(self) -> bool:
        """The model object's mode: `model.train()` / `model.eval()` on the user's model switch the engine too."""
        return self.module.training

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        self.templates.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # -- one micro-batch --------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> CausalLMOutputWithPast:
        return self.forward(*args, **kwargs)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                return_logits: bool = False, num_items_in_batch: int | torch.Tensor | None = None,
                logits_to_keep: int | torch.Tensor = 0, **unused: Any) -> CausalLMOutputWithPast:
        check_batch(self.hf_config, input_ids, attention_mask, labels, position_ids, unused)
        t0 = time.perf_counter()
        self.templates.train(self.training)  # the user may have switched modes on the model object itself
        train = self.training and torch.is_grad_enabled()
        dev = self.device
        ids = input_ids.to(dev, torch.long, non_blocking=True)  # check_batch admits int8..int32; embedding takes long
        mask = attention_mask.to(dev, non_blocking=True) if attention_mask is not None else None
        pos = position_ids.to(dev, non_blocking=True) if position_ids is not None else None
        with torch.no_grad():
            h0 = self.parts.embed(ids)
        h0.requires_grad_(train)  # the lookup's gradient is scattered by hand in backward (no vocab x hidden)
        with torch.set_grad_enabled(train):
            h_in0, layer_inputs = record_layer_inputs(self.parts, self._recorded, h0, mask, pos)
        offload = self.pipeline.plan_batch(int(ids.numel()), self.config.offload_activations)
        acts = ActivationStore(self.streams, offload, pin=self.pipeline.act_pool) if train else None
        with torch.no_grad():
            h_last = self.pipeline.forward(h_in0.detach(), layer_inputs, acts)
        h_last = h_last.detach().requires_grad_(train)
        with torch.set_grad_enabled(train):
            hn = self.parts.norm(h_last)
            loss = None
            if labels is not None:
                loss = chunked_causal_lm_loss(hn, self.parts.lm_head, labels,
                                              self.pipeline.loss_chunk(self.config.loss_chunk_tokens),
                                              num_items_in_batch, self.parts.softcap)
            logits = head_logits(hn, self.parts.lm_head, logits_to_keep, self.parts.softcap) if return_logits else None
        if train and (loss is not None or logits is not None):
            if self._pending is not None:
                self._unbackwarded.append(weakref.ref(self._pending.h_last))
            self._pending = _Pending(h0, h_in0, h_last, layer_inputs, acts, ids)
            self._act_peak = max(self._act_peak, acts.peak_device_bytes)
            h_last.register_hook(self._only_through_backward)
        self._stats["forward_s"] += time.perf_counter() - t0
        self._tokens += int(ids.numel())
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _only_through_backward(self, grad: torch.Tensor) -> torch.Tensor:
        # Plain loss.backward() would reach only the head and norm (the layers ran outside autograd) and
        # leave partial gradients: refuse it loudly.
        if not self._autograd_running:
            # The head's and norm's gradients may already be in their slabs: no step until zero_grad().
            self._stray_backward = True
            raise RuntimeError("loss.backward() cannot train a MegaTrain model: the decoder layers ran outside "
                               "autograd. Call engine.backward(loss) (DeepSpeed face) or accelerator.backward(loss)")
        return grad

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """Add d(loss)/d(params) into the host gradient slabs (accumulates across calls).

        `loss` is any scalar computed from the last training forward's outputs: its `.loss`, or a loss
        of your own computed from its `.logits` (label smoothing, distillation, ...), or both combined.
        Data parallel: with `sync` (the last micro-batch before a step) each layer's slab is averaged
        across ranks as it lands, overlapped with the next layer's backward; with `sync=False` the
        gradients stay local until a synchronising backward (or the next step, which averages them then).
        """
        p = self._pending
        if p is None:
            raise RuntimeError("backward() needs a training forward first (model.train(), grad enabled, with "
                               "labels or with logits returned)")
        if not torch.is_tensor(loss) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("backward() takes a scalar loss computed (with autograd) from the last training "
                             "forward's .loss or .logits")
        self._check_one_backward()
        earlier = [r() for r in self._unbackwarded]
        earlier = [h for h in earlier if h is not None]
        self._pending = None
        self._unbackwarded = []
        self._norm = None
        t0 = time.perf_counter()
        params = self._device_globals
        average = self.dp is not None and sync
        average_layers = average and self.node is None  # a shared store reduces every backward's, to the owners
        if self.dp is not None:
            # The resident parameters' slab may still be being averaged (last backward): the adds below wait.
            self.pipeline.synchronize_global_grads()
        if self._in_backward:
            self._layered.sync_all()  # this step's LR and state, taken before the first layer update
            self._unstepped = True
        self._backwards += 1
        self._autograd_running = True
        try:
            g, *grads = torch.autograd.grad(loss, [p.h_last, *params, *earlier], allow_unused=True)
        finally:
            self._autograd_running = False
        if any(e is not None for e in grads[len(params):]):
            raise RuntimeError("the loss depends on an earlier forward whose backward was not run; MegaTrain "
                               "backpropagates one forward at a time: call backward() after each forward")
        grads = grads[: len(params)]
        if g is None:
            raise ValueError("the loss does not depend on the last forward's outputs (.loss / .logits)")
        self._add_global_grads(grads)
        del grads  # the head's gradient is vocab x hidden: free it before the layers run
        self.pipeline.grad_sent = self._average_layer if average_layers else None
        try:
            g = self.pipeline.backward(g, p.layer_inputs, p.acts)
        finally:
            self.pipeline.grad_sent = None
        if p.h_in0 is p.h0:
            g_h0, grads = g, ()
        else:
            g_h0, *grads = torch.autograd.grad(p.h_in0, [p.h0, *params], g, allow_unused=True)
        self._add_global_grads(grads)
        self._add_embedding_grad(p.ids, g_h0)
        if average:
            self._average_globals()
        if self.dp is not None:
            self._unaveraged = not sync
        self._stats["backward_s"] += time.perf_counter() - t0

    # -- data parallel -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.dp.rank if self.dp is not None else 0

    @property
    def world_size(self) -> int:
        return self.dp.world_size if self.dp is not None else 1

    def _average_layer(self, i: int) -> None:
        pl = self.pipeline
        pl.landed[i] = self.dp.submit_average(self.store.layers[i], pl.landed[i], f"layer {i}", i)

    def _average_globals(self) -> None:
        pl = self.pipeline
        pl.globals_landed.append(self.dp.submit_average(self.store.globals, list(pl.globals_landed),
                                                        "the resident parameters (embedding, norm, head)", -1))

    def _average_pending(self) -> None:
        """Average gradients a backward(sync=False) left local before anything reads them (a step, a norm).

        Averaging a slab that holds an already-averaged part plus local parts is still exact, so this is
        right whatever mix of synchronising and local backwards came before.
        """
        if self.dp is None or not self._unaveraged:
            return
        if self.node is None:
            for i in reversed(range(len(self.store.layers))):
                self._average_layer(i)
        self._average_globals()
        self._unaveraged = False

    def _check_one_backward(self) -> None:
        """Refuse what these modes cannot do exactly, before any gradient is added."""
        if self._failed_layer is not None:
            raise FloatingPointError("a previous optimizer_in_backward step was cut short by a non-finite gradient; "
                                     "load a checkpoint (load_state_dict / load_checkpoint) before training on")
        if self._in_backward and self._unstepped:
            raise RuntimeError("optimizer_in_backward: the last backward() already updated the layers, so its step() "
                               "must come before the next backward (gradient accumulation is not possible in this "
                               "mode); use gradient_accumulation_steps=1, or optimizer_in_backward=false")
        if self.store.grad_mode is GradSlab.BFLOAT16 and self._backwards:
            raise RuntimeError("host_grad_dtype='bfloat16' holds one micro-batch's gradients exactly, not a sum of "
                               "several (bf16 addition rounds): call zero_grad() between backward() calls, i.e. "
                               "gradient_accumulation_steps=1, or use host_grad_dtype='float32' to accumulate")

    def _update_in_backward(self, i: int, staging: torch.Tensor, staged: Event) -> Event:
        """Queue layer i's AdamW update behind the staging of its gradients (optimizer_in_backward)."""
        group = self.store.layers[i]

        def job() -> int:
            if self._failed_layer is not None:
                return 0  # an earlier layer's gradient was not finite: step() reports it
            gw = group.grad_work
            gw.zero_()
            gw.add_(staging)  # 0 + g: the value an ordinary zeroed FP32 slab holds after one backward
            if self.config.skip_nonfinite and not bool(torch.isfinite(gw).all()):
                self._failed_layer = i
                return 0
            group.unpack()
            self._layered.step_layer(i)
            group.pack()
            return 0

        # Behind the staging copy, and behind whatever last landed for this layer (schedule.py's `landed`).
        return self._layered.submit(i, job, (staged, self.pipeline.landed[i]))

    def _step_in_backward(self) -> bool:
        """step() after an optimizer-in-backward backward: the layers are updated (or the step failed); the globals now."""
        if not self._unstepped:
            raise RuntimeError("optimizer_in_backward: step() without a backward() since the last step")
        self._wait_host_jobs()
        self._unstepped = False
        n = len(self.store.layers)
        bad = self._failed_layer
        if bad is None and self.config.skip_nonfinite and not bool(torch.isfinite(self.store.globals.grad).all()):
            bad = -1
        if bad is not None:
            self._failed_layer = -1 if bad == -1 else bad
            updated = f"layers {bad + 1}..{n - 1}" if bad >= 0 else "every layer"
            raise FloatingPointError(
                f"non-finite gradient ({'layer ' + str(bad) if bad >= 0 else 'embedding/norm/head'}) with "
                f"optimizer_in_backward: {updated} were already updated during backward, so this step cannot be "
                "skipped as skip_nonfinite asks; load the last checkpoint, then lower the LR or check the data")
        for g in self.store.groups():
            g.link_grads()
        self._layered.step_globals()
        self._globals_changed()
        self.pipeline.invalidate()
        return True

    def _add_embedding_grad(self, ids: torch.Tensor, g: torch.Tensor) -> None:
        """Scatter-add the lookup's gradient into the embedding's slab rows (what the embedding module's
        backward computes, scales included, without materializing a dense vocab x hidden gradient)."""
        rows, grad = lookup_grad(self.parts.embed, ids, g)
        self._global_grads.add_rows(self._embed_slot, rows, grad)  # off this thread on CUDA

    def _add_global_grads(self, grads: tuple) -> None:
        self._global_grads.add_dense(grads)  # on CUDA: copy stream + pinned staging, added on a host thread

    def _reduce_to_owner(self, i: int, staging: torch.Tensor, staged: Event) -> Event:
        """Shared host store: queue layer i's gradients' reduction into its owner's slab (every backward)."""
        pl = self.pipeline
        return self.dp.submit_reduce_to_owner(i, staging, self.store.layers[i].grad,
                                              (staged, pl.landed[i], pl.zeroed[i]))

    def _all_grads(self) -> list[torch.Tensor]:
        """This rank's gradient slabs (a shared store: its own layers' and the resident parameters')."""
        self._average_pending()
        self._wait_host_jobs()
        return [g.grad for g in self.store.groups() if g.grad is not None]

    def _wait_host_jobs(self) -> None:
        """Gradients landed in their slabs and (optimizer_overlap) no layer update or zeroing still queued."""
        self.pipeline.synchronize_grads()
        if self._layered is not None:
            self._layered.synchronize()
        if self.node is not None:
            self.dp.synchronize_updates()  # the other ranks' layer updates (shared store, optimizer_overlap)

    def grad_norm(self) -> float:
        """Global L2 norm of the accumulated gradients (torch's norm-of-norms)."""
        if self._in_backward:
            raise RuntimeError("optimizer_in_backward: the layers' gradients are consumed during backward, so there "
                               "is no global gradient norm (nor clipping by it); set optimizer_in_backward=false "
                               "to clip")
        if self._norm is None:
            grads = self._all_grads()
            # A bf16 slab is widened first: the same norm as the FP32 slab holding the same values. A clip
            # still pending on it is applied the same way the FP32 slab would have been scaled.
            norms = []
            for g in grads:
                if g.dtype != torch.float32:
                    g = g.float()
                    for c in self._clip_coefs:
                        g.mul_(c)
                norms.append(torch.linalg.vector_norm(g))
            if self.node is None:
                self._norm = float(torch.linalg.vector_norm(torch.stack(norms)))
            else:
                # Each rank holds its own layers' slabs: their squares summed over the node (every node holds the
                # same sums), plus the resident parameters', which every rank holds whole.
                layers = self.dp.sum_across_node(float(torch.stack(norms[:-1]).double().square().sum())
                                                 if len(norms) > 1 else 0.0)
                self._norm = math.sqrt(layers + float(norms[-1].double()) ** 2)
        return self._norm

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale all gradients so their global L2 norm is at most `max_norm`; return the norm before."""
        total = self.grad_norm()
        coef = min(max_norm / (total + 1e-6), 1.0)
        if coef < 1.0:  # multiplying by exactly 1.0 is what torch does otherwise: a no-op
            for g in self._all_grads():
                if g.dtype == torch.float32:
                    g.mul_(coef)
            if self.store.grad_mode is GradSlab.BFLOAT16:
                self._clip_coefs.append(coef)  # bf16 slabs: scaled in FP32 as they widen (no bf16 rounding)
            self._norm = total * coef
        return total

    def step(self) -> bool:
        """One optimizer step over the host masters (the caller owns zero_grad and LR schedules).

        Returns False when the step was skipped because the gradients were not finite.
        """
        if self._stray_backward:
            raise RuntimeError("a refused loss.backward() left partial gradients (head and final norm only) in the "
                               "gradient slabs; call zero_grad() before the next step")
        t0 = time.perf_counter()
        self._average_pending()
        if self._in_backward:
            done = self._step_in_backward()
            self._stats["optimizer_s"] += time.perf_counter() - t0
            return done
        if self.config.skip_nonfinite and not math.isfinite(self.grad_norm()):
            self.skipped_steps += 1
            self._bad_in_a_row += 1
            self._norm = None
            if self._bad_in_a_row >= self.config.max_bad_steps:
                raise FloatingPointError(
                    f"{self._bad_in_a_row} consecutive steps had non-finite gradients; stopping. Lower the "
                    "learning rate, check the data, or raise megatrain.max_bad_steps")
            warnings.warn(f"non-finite gradient norm: step skipped, parameters unchanged "
                          f"({self.skipped_steps} skipped so far)", stacklevel=2)
            return False
        self._bad_in_a_row = 0
        for g in self.store.groups():
            g.link_grads()
        overlapped = self._layered is not None and self.config.optimizer_overlap
        if self._layered is not None:
            self.pipeline.synchronize_global_grads()  # the globals are updated right away, below
            # Globals now, layers queued in forward order; each layer's load waits for its update.
            layers, coefs = self.store.layers, list(self._clip_coefs)

            def before(i: int) -> None:
                layers[i].load_grads(coefs)
                layers[i].unpack()

            if self.store.per_layer_update:
                self._layered.step(lambda i: layers[i].pack(), self.pipeline.landed, before)
            else:
                self._layered.step(lambda i: layers[i].pack(), self.pipeline.landed)
            self._globals_changed()
            self.pipeline.invalidate()
            if self.node is not None and overlapped:
                # Each layer's next load waits for its owner's update, whichever rank that is: the node's ranks
                # pass a token per layer, in forward order, once the owner's update is done (node_store.py).
                updated = self.pipeline.updated
                for i in range(len(updated)):
                    updated[i] = self.dp.submit_publish(i, updated[i])
            elif not self.config.optimizer_overlap:
                self._layered.synchronize()  # a per-layer mode without overlap: step() returns with every layer done
        else:
            self.pipeline.synchronize_grads()  # the step reads every slab, whatever the knobs
            self.optimizer.step()
            self._masters_changed()
        if self.node is not None and not overlapped:
            # The owners wrote their layers in the node's shared store: nobody loads one before all are written.
            self.dp.node_barrier("waiting for the other ranks' layer updates")
        self._stats["optimizer_s"] += time.perf_counter() - t0
        return True

    def synchronize(self) -> None:
        """Wait for every queued copy and (with optimizer_overlap) the layer updates still running:
        call it before reading parameters, gradients or optimizer state by hand."""
        self.streams.synchronize()
        self._wait_host_jobs()

    def _masters_changed(self) -> None:
        for g in self.store.layers:
            g.refresh_shadow()
        self._globals_changed()
        self.pipeline.invalidate()

    def _globals_changed(self) -> None:
        if not self._alias_globals:
            with torch.no_grad():
                for dev, master in zip(self._device_globals, self.store.globals.params):
                    dev.copy_(master, non_blocking=True)

    def zero_grad(self) -> None:
        if self._in_backward and self._unstepped:
            raise RuntimeError("optimizer_in_backward: the last backward() already updated the layers; zero_grad() "
                               "before step() cannot discard that update. Call step() after each backward()")
        self._stray_backward = False
        self.pipeline.synchronize_grads()
        self._clip_coefs = []
        self._backwards = 0
        if self._layered is not None and not self._in_backward:
            self._layered.zero_grad()  # each layer's after its queued update, off this thread
        else:
            self.store.zero_grad()
        self._norm = None
        self._unaveraged = False

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named FP32 copies of every parameter (tied weights under each of their names)."""
        self.synchronize()
        named = dict(self.named_parameters())
        out = {n: p.detach().clone() for n, p in named.items()}
        out.update({a: out[n] for a, n in self._aliases.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        named = self._slots_by_name()
        missing = [n for n in named if n not in state]
        unexpected = [n for n in state if n not in named and n not in self._aliases]
        if strict and (missing or unexpected):
            raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.synchronize()
        with torch.no_grad():
            for n, (group, slot) in named.items():
                if n in state:
                    if tuple(state[n].shape) != tuple(slot.shape):
                        raise ValueError(f"{n}: shape {tuple(state[n].shape)} does not match {tuple(slot.shape)}")
                    if group.owned:  # a shared store: each layer written once, by its owner
                        group.write_slot(slot, state[n])
        self._failed_layer = None
        self._unstepped = False
        self._masters_changed()
        if self.node is not None:
            self.dp.node_barrier("waiting for the other ranks to load their layers")

    # -- accounting ---------------------------------------------------------------------------------
    @property
    def device_weight_bytes(self) -> int:
        """Weight bytes resident on the device: the k layer buffers plus embedding/norm/head."""
        g = sum(p.numel() * p.element_size() for p in self._device_globals)
        return self.pipeline.device_weight_bytes + g

    @property
    def stats(self) -> dict[str, float]:
        return self.collect_stats()

    def reset_stats(self) -> None:
        self.streams.reset_counters()
        if self.dp is not None:
            self.dp.stream.reset_counters()
        if self._layered is not None:
            self._layered.reset_counters()
        self._act_peak = 0
        if self.memory is not None:
            self.memory.reset_peak()
        self._tokens = 0
        self._stats = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
        self.trace_log.clear()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def collect_stats(self) -> dict[str, float]:
        """Accounting since the last reset (waits for outstanding copies and layer updates)."""
        self.synchronize()
        out = dict(self._stats)
        if self._layered is not None:
            out["optimizer_busy_s"] = self._layered.busy_s  # on its own thread; optimizer_s is what step() took
        out.update(
            h2d_bytes=self.streams.h2d.bytes, d2h_bytes=self.streams.d2h.bytes,
            h2d_busy_s=self.streams.h2d.busy_s, d2h_busy_s=self.streams.d2h.busy_s,
            copy_wait_s=self.streams.wait_s, device_weight_bytes=self.device_weight_bytes,
            peak_activation_bytes=self._act_peak, host_store_bytes=self.store.host_bytes(),
            tokens=self._tokens,
        )
        if self.device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        else:
            # Measured live bytes when tracking (tiled working set, loss workspace included), else the count.
            out["peak_device_bytes"] = self.device_weight_bytes + (self.memory.peak if self.memory else self._act_peak)
        out.update(self.pipeline.plan_stats())
        if self.dp is not None:
            out.update(allreduce_bytes=self.dp.stream.bytes, allreduce_busy_s=self.dp.stream.busy_s)
        return out

    @property
    def trace(self) -> list:
        return list(self.trace_log.records)

    @property
    def num_templates(self) -> int:
        return len(self.templates)
