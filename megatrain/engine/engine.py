"""The engine: composes the host store, templates, streams and pipeline into forward / backward / step.

The model it is given stays the user's whole model object: its parameters become the store's masters
(placement.py) and its forward is routed here (model_object.py). When and on which thread each layer's
update runs is the update path's (update.py), what the data-parallel ranks add is ranks.py's, and every
queued job orders itself by the per-layer events (events.py).
"""

from __future__ import annotations

import math
import os
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from ..config.schema import EngineConfig
from ..config.settle import LATER, LAYERED, WHOLE, EngineFacts, settle_engine
from ..costs.advice import PlacementAdvice
from ..costs.modes import GradSlab, HostMaster
from ..models.adapter import DecoderParts, find_parts, record_layer_inputs
from . import given
from .accounting import StepAccounting
from .host.events import LayerEvents
from .host.loading import skeleton_from_dir
from .host.node_store import shard_optimizer_state
from .host.preflight import host_facts
from .host.slab_state import landed_norms, slab_norm
from .host.spill import spill_for
from .layer.attention import host_mask, use_segment_attention
from .layer.batch import check_batch
from .layer.embedding import check_embedding, lookup_grad
from .layer.loss import TileBuffers, chunked_causal_lm_loss, head_logits, logits_tokens, tiled_norm_head_loss
from .layer.router import model_router_loss, wants_router_loss
from .layer.side_inputs import SideInputs
from .layer.tiling import long_context_policy, side_numel
from .model.model_object import bind as bind_model_object
from .model.model_object import engines_holding
from .model.peft_model import attach_adapters, unwrap_peft
from .model.placement import place, resolve_device
from .model.probe import verify_model
from .model.trainable import Trainable, frozen_names, user_flags
from .oom_step import layers_backward, lowered_on_oom, redone_once_on_oom, update_step  # OOM: redone (oom.py)
from .parallel import node_path, shared_store
from .parallel.distributed import join_ranks
from .parallel.ranks import ranks_for
from .pipeline.activations import ActivationStore
from .pipeline.global_grads import GlobalGradSink
from .pipeline.schedule import LayerPipeline
from .runtime.host_copy import HostCopy, host_value, to_device, to_host
from .runtime.malloc import set_mmap_threshold
from .runtime.memtrack import DeviceMemoryTracker, resident_state, tracked
from .runtime.numa import bind_host
from .runtime.stream import Streams
from .update import resident, speculative
from .update.choose import choose as choose_update
from .update.clipping import Clipping, checked_max_norm
from .update.optim import LayeredStep, OptimizerArg, adopt_optimizer, unsupported_reason

__all__ = ["Engine", "OptimizerArg", "engines_holding", "resolve_device"]

def _has_dropout(cfg: Any) -> bool:
    return any((getattr(cfg, k, 0) or 0) > 0 for k in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop",
                                                         "attn_pdrop", "router_jitter_noise", "input_jitter_noise",
                                                         "moe_jitter_eps"))


@dataclass
class _Pending:
    """What backward needs from the forward it follows."""

    h0: torch.Tensor  # embedding output, a leaf
    h_in0: torch.Tensor  # layer-0 input: h0 after any model-level math (scales, position embeddings)
    h_last: torch.Tensor  # last layer's output, a leaf the head was computed from
    layer_inputs: list
    acts: ActivationStore
    ids: torch.Tensor
    router_leaves: list[tuple[int, torch.Tensor]]  # (layer, its router logits as a leaf the loss was computed from)
    # The batch's ids in host memory (the embedding's rows): as given, or a device batch's copied back (queued).
    host_ids: torch.Tensor | HostCopy | None = None
    tile: int | None = None  # its MLP tile (an eval forward in between plans its own)
    side: SideInputs | None = None  # the layers' inputs besides the hidden state that carry a gradient


def optimizer_fact(optimizer: OptimizerArg) -> str:
    """What `optimizer` is to the engine's "auto" (megatrain/config/resolve.py EngineFacts): the engine's own AdamW
    (None) and torch's Adam/AdamW step a layer at a time (LAYERED), others whole (WHOLE). A factory is taken as
    torch's Adam/AdamW (the engine's and DeepSpeed configs' optimizers); one that builds another optimizer steps
    whole, as the update path says when it is built (engine/update/choose.py)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return LAYERED if unsupported_reason(optimizer) is None else WHOLE
    return LAYERED


class Engine:
    """Train a Hugging Face decoder-only LM whose weights and optimizer state live in host memory."""

    def __init__(self, model: nn.Module | str | os.PathLike, config: EngineConfig | None = None,
                 optimizer: OptimizerArg = None, clip_every_step: float = 0.0,
                 placement_advice: PlacementAdvice | None = None, *, optimizer_later: bool = False,
                 pin_by_habit: bool = False) -> None:
        """`config` as written, settled once into the plan the engine is built from (`config` afterwards). `clip_every_step`:
        clip by this norm at each step() not preceded by a clip_grad_norm_. `placement_advice`: residency "auto" placed
        by a timing model, under a device budget. `optimizer_later`: handed over later; `pin_by_habit`: unpinned on CPU."""
        clip_every_step = checked_max_norm(clip_every_step)  # refused before any work
        written = config or EngineConfig()  # until the plan: what settling leaves as written
        self.device, self.dp, self.trace_log = join_ranks(resolve_device(written.device), written.watchdog_s,
                                                          written.trace)
        bind_host(self.device)  # before the store exists: its pages first touched on the GPU's NUMA node (numa.py)
        self.compute_dtype = torch.bfloat16 if written.compute_dtype == "bfloat16" else torch.float32
        if written.host_mmap_threshold_bytes is not None:
            set_mmap_threshold(written.host_mmap_threshold_bytes)  # before the model's weights are freed
        checkpoint_dir = None
        if isinstance(model, (str, os.PathLike)):
            checkpoint_dir = Path(model)
            model = skeleton_from_dir(checkpoint_dir)
        # A PEFT model: the HF model inside it is what trains (peft_model.py); the wrapper is what the faces hand back.
        model, self.wrapper = unwrap_peft(model)
        self.parts: DecoderParts = find_parts(model)
        check_embedding(self.parts.embed)
        self.module, self.hf_config = model, model.config
        # The plan, settled once before anything is built: the device, the optimizer, the model's host bytes.
        agree = (lambda i: self.dp.max_across(i, "host mode")) if self.dp is not None else None
        facts = EngineFacts(self.device.type, LATER if optimizer_later else optimizer_fact(optimizer), pin_by_habit,
                            host_facts(written, model, self.parts.layers, agree=agree))
        config = settle_engine(written, facts)[0]
        # Several ranks: one host store per node (host/node_store.py), or one the nodes share (parallel/shared_store.py)
        self.node = shared_store.host_store(self.dp, config, model, self.parts.layers)
        probe = (lambda m: verify_model(m, type(self), config)) if config.parity_probe else None
        node_path.plan(self.node, self.dp, config, LATER if optimizer_later else optimizer, self.device)  # before the store
        frozen, flags = frozen_names(model, optimizer), user_flags(model)  # the user's flags, before the masters
        self.placement, originals = place(model, self.parts, config, self.device, self.compute_dtype, self.dp,
                                          self.node, checkpoint_dir, probe, frozen)
        self.store, self.templates = self.placement.store, self.placement.templates
        self._aliases, self._name_of = self.placement.aliases, self.placement.name_of  # read by the faces, the probe
        # What trains (trainable.py): the user's flags on the masters; no slab for a layer none of whose parameters
        # train (before the optimizer residency below moves slabs).
        self.trainable = Trainable(self.store, self.parts, frozen, flags)
        self.trainable.apply(self.placement.device_globals)  # and a frozen embedding (head, norm) has no slab either
        self._recorded: list = []

        self.streams = Streams(self.device, self.trace_log, config.link_gbps, config.watchdog_s)
        # Long context: attention without an O(tokens²) mask, per-batch MLP tiling and activation offload (tiling.py)
        self.hf_attention = self.hf_config._attn_implementation  # the model's own, for its own forward (generate)
        self.segment_attention = use_segment_attention(self.hf_config, config.segment_attention)
        policy = long_context_policy(config, self.templates.of_layer, [g.numel for g in self.store.layers],
                                     config.num_buffers, self.device, self.compute_dtype,
                                     sum(p.numel() * p.element_size() for p in self.placement.device_globals),
                                     self.parts.lm_head.weight.shape, side_numel(self.parts))
        # forward and backward run under it (@tracked), when it is on
        self.memory = DeviceMemoryTracker(self.device) if config.measure_device_memory else None

        # Optimizer residency (update/resident.py): the first layers' masters moved onto the device before the
        # optimizer is built over them (its Adam state is made beside them); "auto" sizes it from the device budget.
        # With advice (a device budget only: with none, everything fits and the fill is every layer) its count.
        self.placement_advice = placement_advice if policy.budget is not None else None
        if self.placement_advice is not None:
            # asked before speculation's verdict: the planner sizes that step as the engine is about to
            advice, asked = self.placement_advice, config
            policy.advise = lambda tokens, k: advice.residency(asked, tokens, policy.budget, k)
        auto = 0
        if resident.auto_applies(config, self.device, self.store):
            auto = (self.placement_advice.optimizer_layers(config, policy.budget) if self.placement_advice else
                    policy.optimizer_layers(resident.reserve_tokens(self.hf_config), self.store.globals.numel))
        count = resident.resolve(config, self.store, self.dp is not None, auto)
        self.optimizer_layers = resident.place(self.store, count, self.device)
        # The resident parameters go with them (first: the next forward reads the embedding first): their gradients
        # added on the device, their update the device's, their compute copy refreshed there (no upload).
        self.globals_on_device = resident.place_globals(self.store, count, self.device)
        if self.globals_on_device:
            self.placement.stop_upload()
        policy.hold_optimizer(count, self.store.globals.numel if self.globals_on_device else 0)
        # The step: the optimizer over the masters, what the ranks exchange, and when each layer's update runs.
        self.events = LayerEvents(len(self.store.layers), config.watchdog_s)
        named = self.store.named_parameters(self.parts.layers_prefix)
        if not isinstance(optimizer, torch.optim.Optimizer):  # built here: over what trains only
            named = [(n, p) for n, p in named if self.trainable.trains(p)]
        opt = adopt_optimizer(optimizer, named, self._name_of, self._aliases)
        del originals
        self._hold_trainable(opt)
        if self.node is not None:
            foreign = {id(p) for g in self.store.layers if not g.owned for p in g.params}
            shard_optimizer_state(opt, foreign, self.dp.group, self.synchronize)
        self.ranks = ranks_for(self.dp, self.store, self.events)
        # IF_FITS: the first host-updated layers whose rollback copies fit, measured now the store is held; the plan
        # with that verdict is the engine's config, assigned once (True refused where it cannot run)
        speculate = speculative.resolve(config, self.device, opt, self.store, self.dp is not None, self.optimizer_layers)
        back_off = config.speculation_backs_off
        self.config = config = config.measured(bool(speculate))
        # The optimizer in backward: one verdict per step from every rank; the NVMe tier, when configured.
        self.update = choose_update(opt, self.store, self.events, config, self.trace_log,
                                    agree=self.ranks.agree_max if self.dp is not None else None,
                                    spill=spill_for(self.store, config, self.node), device_layers=self.optimizer_layers,
                                    speculate=speculate, back_off=back_off)
        self.spill = self.update.spill
        # The device-resident optimizer state, measured where the plan counts it (memtrack): under a budget. With none
        # (a CPU device) the plan leaves it to the host store, held before any batch (costs/memory.py hold_optimizer).
        if self.memory is not None and policy.budget is not None:
            self.memory.hold(lambda: resident_state(self.store, self.optimizer_layers, self.globals_on_device, opt))
        self.pipeline = LayerPipeline(self.store, self.templates, self.streams, self.trace_log, config.num_buffers,
                                      self.compute_dtype, self.device, _has_dropout(self.hf_config), self.events,
                                      policy, self.ranks.sink(self.update.grad_sink), self.optimizer_layers,
                                      self.trainable)
        # which data path runs: the node path loads the streamed layers by shard and all-gather (node_path.py)
        self.data_path = shared_store.attach(self.pipeline, self.streams, self.dp, self.node, self.ranks, config)
        self._global_grads = GlobalGradSink(self.store, self.streams, self.pipeline, self.compute_dtype)
        attach_adapters(self.pipeline, self.placement, self._global_grads)  # PEFT's adapters: resident (peft_model.py)
        # A plain CPU device keeps the loss tile's buffers (its allocator maps them afresh each time); not where it
        # stands in for a GPU's memory, whose caching allocator reuses them (loss.py TileBuffers).
        self._tile_buffers = TileBuffers() if self.pipeline.alias_kept and self.memory is None else None

        # Where a clip's scaling lands (at once, folded into the update, as a bf16 slab widens), and each step's clip.
        self.clipping = Clipping(self.store.grad_mode, self.update.folds_clip, self._all_grads, clip_every_step)
        self._backwards = 0  # backward() calls since zero_grad()
        self._pending: _Pending | None = None
        self._unbackwarded: list[weakref.ref] = []  # training forwards replaced before their backward
        self._autograd_running = False  # inside backward()'s autograd call (loss.backward() is refused)
        self._stray_backward = False  # a refused loss.backward() may have left head/norm gradients behind
        self._norm: float | None = None  # cached gradient norm, valid until grads change
        self._norm_at: list[int] | None = None  # the slabs' version counters when _norm was taken (None: unchecked)
        self.skipped_steps = 0
        self._bad_in_a_row = 0
        self.accounting = StepAccounting(self.device, self.streams, self.pipeline, self.placement, self.dp,
                                         self.update.layered, self.memory, self.trace_log, self.data_path)
        bind_model_object(self)  # and counted among the live engines (engines_holding)
        self.train()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the update path steps (one object: replacing it here replaces it there)."""
        return self.update.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.update.optimizer = optimizer

    def replace_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Step `optimizer` instead of the one the engine was built with, before the first step (given.py)."""
        return given.replace_optimizer(self, optimizer)

    def _hold_trainable(self, optimizer: torch.optim.Optimizer) -> None:
        given.hold_trainable(self, optimizer)

    @property
    def _layered(self) -> LayeredStep | None:
        """The per-layer optimizer views and their thread, when the update path has them."""
        return self.update.layered

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
        if self.parts.other_head:  # a head of the model's own (adapter.py): its forward applies it, its base runs here
            return self.module(*args, **kwargs)
        return self.forward(*args, **kwargs)

    @redone_once_on_oom  # a device out-of-memory error lowers residency once and redoes the forward (oom.py)
    @tracked
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                return_logits: bool = False, num_items_in_batch: int | torch.Tensor | None = None,
                logits_to_keep: int | torch.Tensor = 0, output_router_logits: bool | None = None,
                return_hidden: bool = False,
                **unused: Any) -> CausalLMOutputWithPast:
        if self.parts.other_head and not return_hidden:
            raise ValueError(f"{type(self.module).__name__} has a head of its own (`{self.parts.head_name}`): call the "
                             "model (engine(**batch) or the model object), whose forward applies it; Engine.forward "
                             "serves its decoder base (return_hidden=True)")
        # A device batch's values are checked at the end of this forward (no sync per micro-batch, batch.py).
        pending = check_batch(self.hf_config, input_ids, attention_mask, labels, position_ids, unused)
        self.update.before_forward()  # a speculative update not yet validated: this forward reads the weights before it
        t0 = time.perf_counter()
        self.templates.train(self.training)  # the user may have switched modes on the model object itself
        train = self.training and torch.is_grad_enabled()
        dev = self.device
        ids = to_device(input_ids, dev, torch.long)  # check_batch admits int8..int32; embedding takes long
        if pending is not None:
            ids, labels = pending.sanitize(ids, labels)
        # A device batch's ids go back to the host now, queued, for backward's embedding rows (no torch.unique on
        # the device there, which would wait for the device's queue).
        queued_ids = to_host(ids) if train and input_ids.device == ids.device and ids.device.type != "cpu" else None
        mask = to_device(attention_mask, dev) if attention_mask is not None else None
        pos = to_device(position_ids, dev) if position_ids is not None else None
        if pending is not None:  # indexable until verify() refuses them (a learned table past its end: a device assert)
            pos = pending.sanitize_positions(pos)
        with torch.no_grad():
            h0 = self.parts.embed(ids)
        h0.requires_grad_(train)  # the lookup's gradient is scattered by hand in backward (no vocab x hidden)
        with torch.set_grad_enabled(train), host_mask(attention_mask):  # the mask's layout read on the host
            h_in0, layer_inputs = record_layer_inputs(self.parts, self._recorded, h0, mask, pos, ids)
        # Inputs besides the hidden state computed from trained parameters (per-layer input embeddings): the layers
        # take detached copies; their gradients come back through the recorded graph (layer/side_inputs.py).
        side = SideInputs(layer_inputs)
        layer_inputs = side.detached
        # The stack ran from the embedding output, so it handed its layers no token ids; a layer that reads them
        # (DeepSeek-V4's hash-routed experts) gets the batch's, as in the model's own forward from input_ids.
        layer_inputs = [(a, {**kw, "input_ids": ids} if "input_ids" in kw and kw["input_ids"] is None else kw)
                        for a, kw in layer_inputs]
        if train and self._pending is not None and (labels is not None or return_logits or return_hidden):
            # Replaced: its backward can no longer run, so what it kept (graphs, inputs) is freed before this plan.
            self._unbackwarded.append(weakref.ref(self._pending.h_last))
            self._pending = None
        # Only a training forward may change the placement (an eval between a forward and its backward does not).
        offload = self.pipeline.plan_batch(int(ids.numel()), self.config.offload_activations, train,
                                           logits_tokens(ids, logits_to_keep) if return_logits else 0)
        plan = self.pipeline.last_plan if self.pipeline.policy is not None else None
        acts = ActivationStore(self.streams, offload, pin=self.pipeline.act_pool,
                               **({"in_flight": plan.in_flight} if plan is not None else {})) if train else None
        # A mixture-of-experts loss includes the router term: record every layer's router logits (router.py).
        # With return_hidden and no labels (a head of the caller's own) `.loss` is the router term alone.
        routed = ((labels is not None or return_hidden) and self.templates.routed
                  and wants_router_loss(self.parts, output_router_logits))
        self.templates.recorded = {} if routed else None
        try:
            with torch.no_grad():
                h_last = self.pipeline.forward(h_in0.detach(), layer_inputs, acts, side=side)
            recorded, self.templates.recorded = self.templates.recorded or {}, None
        finally:
            self.templates.recorded = None
        h_last = h_last.detach().requires_grad_(train)
        router_leaves = [(i, z.detach().requires_grad_(train)) for i in sorted(recorded) for z in recorded[i]]
        # Training on labels alone: final norm + head + loss in sequence tiles, each tile's backward run now
        # (loss.py), so only the last hidden state's gradient waits for backward, not a normed copy and its graph.
        in_forward = train and labels is not None and not (return_logits or return_hidden)
        # a head/norm left out of the optimizer (its flag True): no gradient computed for it (trainable.py)
        with torch.set_grad_enabled(train), self.trainable.idle_unflagged(self.placement.device_globals):
            hn = None if in_forward else self.parts.norm(h_last)
            loss = None
            if in_forward:
                loss = tiled_norm_head_loss(h_last, self.parts.norm, self.parts.lm_head, labels,
                                            self.head_chunk_tokens(), num_items_in_batch, self.parts.softcap,
                                            # the head's gradient is one of them: not where a worker adds it
                                            # after backward returns, as the next forward may overwrite it
                                            None if self._global_grads.asynchronous else self._tile_buffers)
            elif labels is not None:
                loss = chunked_causal_lm_loss(hn, self.parts.lm_head, labels, self.head_chunk_tokens(),
                                              num_items_in_batch, self.parts.softcap)
            aux = None
            if routed:
                # labels only make the model's forward take its loss path; its token loss is swapped for zero
                extra, aux = model_router_loss(self.parts, [z for _, z in router_leaves], ids, mask, pos,
                                               ids if labels is None else labels)
                loss = extra.to(h_last.device) if loss is None else loss + extra.to(loss.device)
            logits = head_logits(hn, self.parts.lm_head, logits_to_keep, self.parts.softcap) if return_logits else None
        if pending is not None:
            pending.verify()  # before the results are returned (the copy back was queued at the start)
        if train and (loss is not None or logits is not None or return_hidden):
            self._pending = _Pending(h0, h_in0, h_last, layer_inputs, acts, ids, router_leaves,
                                     input_ids if input_ids.device != ids.device else queued_ids,
                                     self.pipeline.tile, side)
            self.accounting.act_peak = max(self.accounting.act_peak, acts.peak_device_bytes)
            h_last.register_hook(self._only_through_backward)
        self.accounting.seconds["forward_s"] += time.perf_counter() - t0
        self.accounting.tokens += int(ids.numel())
        # return_hidden: the LM head's input (final norm applied) as a one-tuple, for heads of the caller's own
        # that never build the full logits (TRL's fused head); a loss computed from it trains like `.loss`.
        hidden = (hn,) if return_hidden else None
        if routed:
            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits, hidden_states=hidden)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden)

    def head_chunk_tokens(self) -> int:
        """Tokens per LM-head chunk for the last forward's batch: any head over the hidden state (the chunked
        loss, TRL's fused head) holds at most this many tokens x vocab logits at a time."""
        return self.pipeline.loss_chunk(self.config.loss_chunk_set)

    def _only_through_backward(self, grad: torch.Tensor) -> torch.Tensor:
        # Plain loss.backward() would reach only the head and norm (the layers ran outside autograd) and
        # leave partial gradients: refuse it loudly.
        if not self._autograd_running:
            # The head's and norm's gradients may already be in their slabs: no step until zero_grad().
            self._stray_backward = True
            raise RuntimeError("loss.backward() cannot train a MegaTrain model: the decoder layers ran outside "
                               "autograd. Call engine.backward(loss) (DeepSpeed face) or accelerator.backward(loss)")
        return grad

    @lowered_on_oom  # an OOM outside the layers (head, embedding): residency lowered for the next steps, raised
    @tracked
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
        self.update.check_backward()
        if self.store.grad_mode is GradSlab.BFLOAT16 and self._backwards:
            raise RuntimeError("host_grad_dtype='bfloat16' holds one micro-batch's gradients exactly, not a sum of "
                               "several (bf16 addition rounds): call zero_grad() between backward() calls, i.e. "
                               "gradient_accumulation_steps=1, or use host_grad_dtype='float32' to accumulate")
        earlier = [r() for r in self._unbackwarded]
        earlier = [h for h in earlier if h is not None]
        self._pending = None
        self._unbackwarded = []
        self._norm = None
        self.clipping.before_backward()
        t0 = time.perf_counter()
        # The resident parameters that train (a frozen one gets no gradient: trainable.py), None in the others' places.
        everyone = self.placement.device_globals
        params = [d for d, t in zip(everyone, self.trainable.globals) if t]
        # The layers' reductions measure their slab's norm as it lands when a step follows this backward (a
        # replicated rank's average would rewrite the slab after it); zero_grad() unlinked .grad: linked again.
        self.events.slabs.measure = sync and self.dp is None
        for group in self.store.layers:
            group.link_grads()
        self.ranks.before_backward()
        self.update.begin_backward()
        self._backwards += 1
        self._autograd_running = True
        try:
            leaves = [z for _, z in p.router_leaves]
            g, *grads = torch.autograd.grad(loss, [p.h_last, *params, *earlier, *leaves], allow_unused=True)
        finally:
            self._autograd_running = False
        router_grads = grads[len(grads) - len(leaves):]
        grads = grads[: len(grads) - len(leaves)]
        # Each layer's router logits' gradient from the router loss joins its recomputed backward (schedule.py).
        self.templates.router_grads = {}
        for (i, _), gz in zip(p.router_leaves, router_grads):
            self.templates.router_grads.setdefault(i, []).append(gz)
        if any(e is not None for e in grads[len(params):]):
            raise RuntimeError("the loss depends on an earlier forward whose backward was not run; MegaTrain "
                               "backpropagates one forward at a time: call backward() after each forward")
        grads = grads[: len(params)]
        if g is None:
            raise ValueError("the loss does not depend on the last forward's outputs (.loss / .logits)")
        self._global_grads.add_dense(self._in_slots(grads))  # on CUDA: copy stream + pinned staging, added on a host thread
        del grads  # the head's gradient is vocab x hidden: free it before the layers run
        self.pipeline.tile = p.tile
        sent = self.update.grad_sent_hook(self.ranks.grad_sent(sync), sync)  # the ranks' average, a speculative update
        floor = self.trainable.backward_floor(everyone)
        g = layers_backward(self, g, p, sent, floor)  # the pipeline's, gone on with after an OOM (oom.py)
        if floor > 0:  # nothing before the layers trains, and no layer below `floor`: backward ends there
            self.ranks.after_backward(sync)
            self.accounting.seconds["backward_s"] += time.perf_counter() - t0
            return
        side_roots, side_grads = p.side.backward_pairs()
        if p.h_in0 is p.h0 and not side_roots:
            g_h0, grads = g, ()
        else:
            g_h0, *grads = torch.autograd.grad([p.h_in0, *side_roots], [p.h0, *params], [g, *side_grads],
                                               allow_unused=True)
            if g_h0 is None:  # the layers' inputs did not depend on the embedding output (h_in0 is h0 otherwise)
                g_h0 = torch.zeros_like(p.h0)
        self._global_grads.add_dense(self._in_slots(grads))
        # The lookup's gradient scattered into the embedding's slab rows (what the embedding module's backward
        # computes, scales included, without a dense vocab x hidden gradient); off this thread on CUDA.
        if self.trainable.embed_trains(self.placement.embed_slot):
            rows, grad = lookup_grad(self.parts.embed, host_value(p.host_ids) if p.host_ids is not None else p.ids,
                                     g_h0)
            self._global_grads.add_rows(self.placement.embed_slot, rows, grad)
        self.ranks.after_backward(sync)
        self.accounting.seconds["backward_s"] += time.perf_counter() - t0

    def _in_slots(self, grads: Any) -> list[torch.Tensor | None]:
        """The trainable resident parameters' gradients `grads` at their slots (None: frozen)."""
        if not grads:
            return []  # none taken (no model-level math between the embedding and the first layer)
        it = iter(grads)
        return [next(it) if t else None for t in self.trainable.globals]

    # -- gradients and the step -------------------------------------------------------------------
    def grad_norm(self) -> float:
        """Global L2 norm of the accumulated gradients (torch's norm-of-norms)."""
        self.update.check_norm()
        if self._norm is not None and self._norm_at is not None and self._norm_at != self._slab_versions():
            self._norm = None  # a slab was written (by hand, between backward and step) since the norm was taken
        if self._norm is None:
            # A bf16 slab is widened first: the same norm as the FP32 slab holding the same values. A clip
            # still pending on it is applied the same way the FP32 slab would have been scaled. A layer's norm
            # as its reduction measured it is taken when its slab is unchanged since (the same call, the same bits).
            norms = []
            slabs = self._all_grads()  # landed first: a reduction still queued would make its cached norm stale
            cached = landed_norms(self.store, self.events.slabs, bool(self.clipping.pending))
            for i, g in enumerate(slabs):
                if cached[i] is not None:
                    norms.append(cached[i])
                    continue
                g = self.clipping.as_read(g)  # widened, the clip still pending on it applied to a copy
                norms.append(slab_norm(g))
            # A device-resident layer's norm is the device's (update/resident.py): combined with the rest on the host.
            self._norm = self.ranks.total_norm([n.cpu() for n in norms])
            self._norm_at = self._slab_versions()
        return self._norm

    def _slab_versions(self) -> list[int]:
        return [g.grad._version for g in self.store.groups() if g.grad is not None]

    def grads_written(self) -> None:
        """Gradients were written in a way torch's version counters do not see (`.grad.data`, a NumPy view):
        forget every cached gradient norm."""
        self._norm = None
        self.events.slabs.invalidate()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale all gradients so their global L2 norm is at most `max_norm`; return the norm before. The scaling
        is applied now or pending on the slabs until the update reads them (engine/update/clipping.py)."""
        total = self.grad_norm()
        coef = self.clipping.clip(total, max_norm)
        if coef < 1.0:
            self._norm = total * coef
            self._norm_at = self._slab_versions()  # the clip's own in-place scaling is not a hand-written change
        return total

    def clip_grad_norm_of(self, parameters: list[torch.Tensor], max_norm: float) -> float:
        """torch's clip_grad_norm_(parameters, max_norm) over the gradients of `parameters` only (given.py)."""
        return given.clip_grad_norm_of(self, parameters, max_norm)

    def _all_grads(self) -> list[torch.Tensor]:
        """This rank's gradient slabs (a shared store: its own layers' and the resident parameters'), landed."""
        self.ranks.average_pending()
        self.events.wait_grads()
        self.update.settle()  # no queued update writes a slab (a speculative one only reads it: not waited for)
        self.ranks.wait()
        return [g.grad for g in self.store.groups() if g.grad is not None]

    @lowered_on_oom  # as backward's, outside the update (oom.py)
    def step(self) -> bool:
        """One optimizer step over the host masters (the caller owns zero_grad and LR schedules).

        Returns False when the step was skipped because the gradients were not finite. Clips first by
        `clipping.every_step` unless clip_grad_norm_ ran since the last step (the norm: `clipping.last_norm`).
        """
        self.clipping.at_step(self.clip_grad_norm_)
        if self._stray_backward:
            raise RuntimeError("a refused loss.backward() left partial gradients (head and final norm only) in the "
                               "gradient slabs; call zero_grad() before the next step")
        t0 = time.perf_counter()
        self.placement.fence_upload()  # a step with no forward since the last: its rounding reads the masters
        self.ranks.average_pending()
        if not update_step(self, self._finite):  # the update's step(), redone after an OOM (oom_step.py)
            return False
        self._norm_at = None  # the update may scale the slabs in place (a folded clip): the norm stays as clipped
        self.clipping.stepped()
        self.ranks.release(self.events, self.update.overlapped)
        self.placement.globals_changed()
        self.pipeline.invalidate()
        self.accounting.seconds["optimizer_s"] += time.perf_counter() - t0
        return True

    def _finite(self) -> bool:
        """Whether the gradients may be applied: with skip_nonfinite a non-finite norm skips the step (counted,
        warned, and fatal after max_bad_steps in a row)."""
        if not self.config.skip_nonfinite or math.isfinite(self.grad_norm()):
            self._bad_in_a_row = 0
            return True
        self.skipped_steps += 1
        self._bad_in_a_row += 1
        self._norm = None
        if self._bad_in_a_row >= self.config.max_bad_steps:
            raise FloatingPointError(
                f"{self._bad_in_a_row} consecutive steps had non-finite gradients; stopping. Lower the "
                "learning rate, check the data, or raise megatrain.max_bad_steps")
        warnings.warn(f"non-finite gradient norm: step skipped, parameters unchanged "
                      f"({self.skipped_steps} skipped so far)", stacklevel=4)  # step()'s caller
        return False

    def zero_grad(self) -> None:
        self.update.check_zero_grad()
        self._stray_backward = False
        self.events.wait_grads()
        self.clipping.zero_grad()
        self._backwards = 0
        self.update.zero_grad()
        self._norm = None
        self.ranks.zero_grad()

    def synchronize(self) -> None:
        """Wait for every queued copy and (with optimizer_overlap) the layer updates still running:
        call it before reading parameters, gradients or optimizer state by hand."""
        self.placement.fence_upload()  # the resident upload, rounded on its worker, queued before the device sync
        self.streams.synchronize()
        self._wait_host_jobs()

    def _wait_host_jobs(self) -> None:
        """Gradients landed in their slabs, and no layer update or zeroing still queued (on any rank)."""
        self.events.wait_grads()
        self.update.synchronize()
        self.ranks.wait()

    # -- parameters and state -----------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The FP32 master of every parameter. With host_master 'hilo' or 'bf16' the layers' values are FP32
        copies made on each call (read-only: write weights with load_state_dict)."""
        if self.store.master_mode is not HostMaster.FP32:
            self.synchronize()
        return self.placement.named_parameters()

    def global_masters(self) -> list[tuple[str, nn.Parameter]]:
        """(HF name, FP32 master) of the resident parameters, tied ones under each of their names."""
        return self.placement.global_masters()

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
        self.placement.take_device_writes()
        self.ranks.take_weights(src)
        self._masters_changed()
        self.ranks.barrier("waiting for the owners' refreshed layers")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named FP32 copies of every parameter (tied weights under each of their names)."""
        self.synchronize()
        named = self.ranks.whole(dict(self.named_parameters()), self.parts.layers_prefix)  # nodes sharing: gathered
        out = {n: p.detach().to("cpu", copy=True) for n, p in named.items()}  # a device-resident layer's too
        out.update({a: out[n] for a, n in self._aliases.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        named = self.placement.slots_by_name()
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
        self.update.weights_loaded()
        self._masters_changed()
        self.ranks.barrier("waiting for the other ranks to load their layers")

    def _masters_changed(self) -> None:
        self.placement.masters_changed()
        self.pipeline.invalidate()

    # -- data parallel -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.dp.rank if self.dp is not None else 0

    @property
    def world_size(self) -> int:
        return self.dp.world_size if self.dp is not None else 1

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (its device index under a launcher)."""
        return self.dp.local_rank if self.dp is not None else 0

    # -- accounting ---------------------------------------------------------------------------------
    @property
    def device_weight_bytes(self) -> int:
        """Weight bytes resident on the device: the k layer buffers plus embedding/norm/head."""
        return self.accounting.device_weight_bytes

    @property
    def stats(self) -> dict[str, float | str]:
        return self.collect_stats()

    def reset_stats(self) -> None:
        self.accounting.reset()
        self.update.reset_stats()

    def collect_stats(self) -> dict[str, float | str]:
        """Accounting since the last reset (waits for outstanding copies and layer updates)."""
        self.synchronize()
        return {**self.accounting.collect(self.optimizer), "speculative_rollbacks": self.update.rollbacks,
                "speculative_layers": getattr(self.update, "speculative_layers", 0),
                "speculative_backoffs": getattr(self.update, "backoffs", 0)}

    @property
    def trace(self) -> list:
        return list(self.trace_log.records)

    @property
    def num_templates(self) -> int:
        return len(self.templates)
