"""The node path's host update by shard (docs/DISTRIBUTED.md section 3): the node's store is updated once per step,
each local rank updating its ranges of every layer (the shard map's, costs/shards.py) on its own update thread.

- State: Adam's m and v (and max v with amsgrad) of every layer live once in the node's shared memory (8 B/param per
  node, not per rank); each rank's optimizer state of a parameter is a view of them, so a checkpoint's state is
  whole on any rank once every rank's update is done (node_store.shard_optimizer_state), while each rank reads and
  writes only its ranges. The step counters stay each rank's own (every rank steps every parameter once).
- Update: torch's own functional Adam/AdamW (the optimizer's kernel: fused, foreach or single-tensor, as it is
  configured) over this rank's pieces of each parameter. Every one of those kernels is elementwise, so a piece
  gets the bits the whole parameter's call gives it; the gradients' pending clip scales the same ranges first
  (FlatGroup.load_grads over a range, as fused.py's tiles do), and the bf16 shadow is refreshed over them after.
- The gradients in those ranges are the node's sum (node_path.NodeGrads: reduce-scattered, landed in this rank's
  slab over its ranges only); the rest of the slab stays zero, so the slab's norm is its ranges' and the node's
  sum of squares (ranks.py SharedStore.total_norm) is the global one: one clip, one verdict on every rank.

Only an FP32 master (with or without its bf16 shadow) and torch's Adam/AdamW are split (node_path.plan): a hi/lo
master's tie table and stochastic rounding are whole-layer state.

The speculative step (speculative.py) runs here as on one GPU: a layer's speculative update is this rank's `update`
of its ranges behind the landing of its shard, and the rollback copy is `written`: exactly what that update writes,
so a rank's restore never touches another rank's ranges of the node's shared master and moments.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from ..host.node_store import Split, register_shared_state, split_of
from ..host.store import FlatGroup, HostStore

STATE_KINDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def split_for(store: HostStore) -> Split | None:
    """The update by shard of `store` (None: whole layers, each by its owner or by the only rank)."""
    return split_of(store.layers[0].master) if store.layers else None


def _functional() -> object:
    """torch's functional Adam, which AdamW's step calls too (decoupled_weight_decay)."""
    return importlib.import_module(torch.optim.Adam.__module__).adam


def make_state(optimizer: torch.optim.Optimizer, store: HostStore, split: Split) -> None:
    """Adam's state of every layer parameter `optimizer` trains, made now (zero moments, step 0, as torch's first
    step makes it) with its moments views of one node-wide buffer per layer and kind. Collective over the node."""
    amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
    kinds = STATE_KINDS if amsgrad else STATE_KINDS[:2]
    layers = store.layers
    bufs = split.node.buffers([(g.numel, torch.float32) for _ in kinds for g in layers], "optimizer state")
    where = {id(p): (i, s) for i, g in enumerate(layers) for p, s in zip(g.params, g.slots)}
    shared: dict[torch.nn.Parameter, tuple[dict[str, torch.Tensor], list[tuple[int, int]]]] = {}
    # The job's first rank keeps them in its optimizer (whole there: its state_dict and a sharded save carry them
    # once); every other rank holds its state dicts beside it (node_store.state_of).
    held: dict | None = None if not dist.is_initialized() or dist.get_rank() == 0 else {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in where:
                continue  # a resident parameter: every rank's own, updated whole
            i, s = where[id(p)]
            views = {k: bufs[j * len(layers) + i][s.offset: s.offset + s.numel].view(s.shape)
                     for j, k in enumerate(kinds)}
            st = {"step": torch.zeros((), dtype=torch.float32), **views}
            if held is None:
                optimizer.state[p] = st
            else:
                held[p] = st
            pieces = [(max(a, s.offset) - s.offset, min(b, s.offset + s.numel) - s.offset)
                      for a, b in split.ranges(layers[i].numel) if a < s.offset + s.numel and b > s.offset]
            shared[p] = (views, pieces)
    register_shared_state(optimizer, shared, held)


def written(view: torch.optim.Optimizer | None, group: FlatGroup, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of everything `update(view, group, coefs, ranges)` writes when `coefs` is empty (a scale writes the
    slab too): this rank's pieces of the master, of Adam's moments (the node's shared memory) and of the bf16
    shadow, and the step counters (each rank's own). The speculative step's rollback copy (speculative.py
    StateCopy): a copy of the whole layer would restore the other ranks' ranges too, over their own updates."""
    if view is None:
        return []
    slot_of = {p.data_ptr(): s for p, s in zip(group.params, group.slots) if s.numel}
    out: list[torch.Tensor] = []
    for g in view.param_groups:
        for p in g["params"]:
            s = slot_of.get(p.data_ptr())
            if s is None:
                continue
            st = view.state[p]
            if "step" in st:
                out.append(st["step"])  # stepped whether or not any of its elements is in the ranges
            flat = p.detach().view(-1)
            for _, _, x, y in _pieces(s, ranges):
                out.append(flat[x:y])
                out.extend(st[k].view(-1)[x:y] for k in STATE_KINDS if k in st)
    if group.shadow is not None and group.master is not None:
        out.extend(group.shadow[a:b] for a, b in ranges)
    return out


def _pieces(slot, ranges: list[tuple[int, int]]):
    """Where `ranges` (offsets in the layer's flat buffer) meet parameter `slot`: (lo, hi) in the flat buffer and
    (x, y) in the parameter, for each range that reaches it."""
    for a, b in ranges:
        lo, hi = max(a, slot.offset), min(b, slot.offset + slot.numel)
        if lo < hi:
            yield lo, hi, lo - slot.offset, hi - slot.offset


def update(view: torch.optim.Optimizer | None, group: FlatGroup, coefs: list[float],
           ranges: list[tuple[int, int]]) -> int:
    """This rank's ranges of layer `group` updated by its optimizer `view` (its gradients times `coefs` first), the
    bf16 shadow refreshed over them; the elements updated."""
    if view is None:
        return 0  # a layer none of whose parameters train
    for a, b in ranges:
        FlatGroup.load_grads(group.range(a, b), coefs)
    slot_of = {p.data_ptr(): s for p, s in zip(group.params, group.slots) if s.numel}
    adam = _functional()
    done = 0
    for g in view.param_groups:
        params, grads, m, v, vmax, steps, stepped = [], [], [], [], [], [], []
        for p in g["params"]:
            s = slot_of.get(p.data_ptr())
            if s is None:
                continue
            st = view.state[p]
            if "exp_avg" not in st:
                raise RuntimeError("the node path's update by shard found a layer parameter without its Adam state in the "
                                   "node's shared memory (an optimizer replaced after the engine was built?); use "
                                   "data_parallel_path='per_rank' for it")
            stepped.append(st["step"])
            flat = p.detach().view(-1)
            for lo, hi, x, y in _pieces(s, ranges):
                params.append(flat[x:y])
                grads.append(group.grad_work[lo:hi])
                m.append(st["exp_avg"].view(-1)[x:y])
                v.append(st["exp_avg_sq"].view(-1)[x:y])
                if g["amsgrad"]:
                    vmax.append(st["max_exp_avg_sq"].view(-1)[x:y])
                steps.append(st["step"].clone())  # each piece steps its own copy: the count goes up once below
                done += y - x
        if params:
            beta1, beta2 = g["betas"]
            adam(params, grads, m, v, vmax, steps, foreach=g.get("foreach"), fused=g.get("fused"),
                 capturable=False, differentiable=False, grad_scale=None, found_inf=None, has_complex=False,
                 decoupled_weight_decay=g.get("decoupled_weight_decay", type(view) is torch.optim.AdamW),
                 amsgrad=g["amsgrad"], beta1=beta1, beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"],
                 eps=g["eps"], maximize=g["maximize"])
        for t in stepped:
            t.add_(1)  # every rank steps every parameter once, its pieces or none
    if group.shadow is not None and group.master is not None:
        for a, b in ranges:
            group.shadow[a:b].copy_(group.master[a:b])
    return done
