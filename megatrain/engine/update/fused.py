"""One pass over a layer's host state per step: the whole AdamW update, gradient in, master out.

The per-layer update used to be whole-layer passes one after another: widen a bf16 gradient slab (or scale
an FP32 one by the clip), join the hi/lo master into the FP32 scratch, torch's fused AdamW over the layer,
split the scratch back (or refresh the bf16 shadow). Each pass streams the whole layer through memory. Here
what crosses memory is the gradient, m, v and the master (or its halves) once each way, which is the bytes
bound of experiments/studies/host_passes.py:

- compiled (adam_kernel.py, where a C compiler is found and its self-check matched torch's kernel): every
  step of the update in one loop per element, each parameter cut into one range per worker;
- otherwise torch ops on a cache-sized tile at a time, every pass on one tile before the next tile is
  touched, so the widened gradient, the joined master and the updated values are read back from cache.

Either AdamW gives torch's bits. torch's fused CPU kernel called on tile views gives the same bits as one call
over the whole tensor as long as every tile starts at a multiple of the kernel's vector width from the
tensor's start (its scalar tail then falls on the same elements; tests/unit/test_fused_pass.py checks this, and
that a misaligned tile is caught); the compiled loop reproduces its vector loop and leaves each parameter's
last numel % 64 elements to it. The clip scale is multiplied into each gradient just before the AdamW reads
it: the same products as scaling the whole slab first. Only torch's Adam/AdamW with fused=True (the engine's
default) take this path, and only once their state exists; anything else updates the layer in whole-layer
passes (update.update_layer).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ...costs.modes import GradSlab, HostMaster
from ..host import hilo
from ..host.store import FlatGroup
from ..runtime.threads import WorkerPool, team
from . import adam_kernel

TILE = 1 << 22  # elements: 256K-element tiles lost more to per-tile overhead than they gained (results/host_passes)
_ALIGN = 1 << 6  # torch's vectorized loops take 16 or 32 FP32 lanes at a time: tiles start on a multiple of 64


def eligible(optimizer: torch.optim.Optimizer, group: FlatGroup) -> bool:
    """Whether `optimizer` (a layer's view) can be stepped tile by tile with the same bits as one step()."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    if group.rounding is not None:
        return False  # stochastic rounding draws its random bits a whole layer at a time
    if group.work is not None and group.work.device.type != "cpu":
        return False  # an optimizer-resident layer on the device (resident.py): torch's own step over the group
    for g in optimizer.param_groups:
        if g.get("fused") is not True or g.get("differentiable") or g.get("capturable"):
            return False
        for p in g["params"]:
            st = optimizer.state.get(p)
            if not st or "exp_avg" not in st:
                return False  # the first step creates the state: torch's own step() does it
            if not (st["exp_avg"].is_contiguous() and st["exp_avg_sq"].is_contiguous()):
                return False
    return True


def _tiles(numel: int, tile: int) -> list[tuple[int, int]]:
    if tile % _ALIGN:
        raise ValueError(f"tile={tile} is not a multiple of {_ALIGN}: the AdamW tails would differ from one call")
    return [(a, min(numel, a + tile)) for a in range(0, numel, tile)]


def _compiled_tile(numel: int, threads: int | None, tile: int) -> int:
    """The compiled loop's tiles: one per worker for each parameter (its calls cost ~0.1 ms of Python each, and
    it needs no cache-sized tiles), so the workers get even shares of every parameter; at most `tile`."""
    n = max(1, threads or team())
    per = -(-numel // n)
    return min(tile, max(_ALIGN, -(-per // _ALIGN) * _ALIGN))


_WORKERS = WorkerPool("fused-pass", exact=True)


def workers(n: int) -> ThreadPoolExecutor:
    """The pool the fused passes run their tiles on (`n` threads, one torch thread each)."""
    return _WORKERS.get(n)


def _split_runs(jobs: list, sizes: list[int], n: int) -> list[list]:
    """`jobs` in `n` contiguous runs of about equal total size."""
    total, parts, part, done = sum(sizes), [], [], 0
    for job, k in zip(jobs, sizes):
        part.append(job)
        done += k
        if done >= total * (len(parts) + 1) / n and len(parts) < n - 1:
            parts.append(part)
            part = []
    return [*parts, part]


def all_finite(x: torch.Tensor, tile: int = TILE, threads: int | None = None) -> bool:
    """Whether every element of the 1-D `x` is finite, without an element-sized temporary: the compiled check of
    the exponent bits (adam_kernel.py), or per tile x * 0, which sums to exactly 0 when every element is finite
    and to NaN otherwise (no overflow, unlike a plain sum)."""
    compiled = adam_kernel.kernel() if x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous() else None
    if compiled is not None:
        tile = _compiled_tile(x.numel(), threads, tile)  # a read of the exponent bits: no temporaries, no tiles
    ranges = [(a, min(x.numel(), a + tile)) for a in range(0, x.numel(), tile)]

    def run(part: list[tuple[int, int]]) -> bool:
        if compiled is not None:
            return all(adam_kernel.all_finite(compiled[0], x[a:b]) for a, b in part)
        # A copy even of FP32 input: mul_ on `.float()` of an FP32 tile would zero the caller's gradients.
        return all(float(x[a:b].to(torch.float32, copy=True).mul_(0).sum()) == 0 for a, b in part)

    n = max(1, min(threads or team(), len(ranges)))
    if n == 1:
        return run(ranges)
    return all(workers(n).map(run, _split_runs(ranges, [b - a for a, b in ranges], n)))


def fused_update(optimizer: torch.optim.Optimizer, group: FlatGroup, coefs: list[float], tile: int = TILE,
                 threads: int | None = None, grad_source: torch.Tensor | None = None) -> None:
    """Layer `group`'s whole update in one pass of tiles (see the module docstring); `optimizer` is the layer's
    view (its params are Parameters over `group.work` in slot order, their .grad views of `group.grad_work`),
    `coefs` the clip scales still pending on the gradients; `grad_source`: the layer's gradients to read instead
    of its slab (the optimizer in backward's staging; taken as 0 + g, what a zeroed FP32 slab would hold). The
    tiles are shared out in contiguous runs between `threads` workers (default: the caller's torch thread
    count), each with one torch thread. Call only where eligible() said so."""
    slot_of = {p.data_ptr(): s for p, s in zip(group.params, group.slots)}
    old_ties = group.ties
    jobs: list[tuple] = []  # (tile start in the layer, end, its op's arguments)
    share: list[int] = []  # the compiled loop's tiles: the worker each goes to (its index within its parameter)
    steps: list[torch.Tensor] = []
    covered: list[tuple[int, int]] = []
    # The compiled loop where it saves passes: a hi/lo or bf16 master (torch's kernel needs it unpacked into a
    # scratch and packed back), or a clip pending on an FP32 slab (scaled and written back in the same loop, not
    # in a pass of its own). An FP32 master with nothing to fold is torch's kernel's own input: measured, the tile
    # path was as fast there (results/host_passes, "fused, torch AdamW" of the FP32 modes).
    folds = bool(coefs) and grad_source is None and group.grad_mode is GradSlab.FLOAT32
    compiled = (adam_kernel.kernel() if (group.master_mode is not HostMaster.FP32 or folds)
                and _compiled_grads(group, grad_source) else None)
    coef_t = torch.tensor(coefs, dtype=torch.float32) if coefs else None
    for g in optimizer.param_groups:
        beta1, beta2 = g["betas"]
        decoupled = g.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
        op = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kw = dict(amsgrad=g["amsgrad"], lr=g["lr"], beta1=beta1, beta2=beta2, weight_decay=g["weight_decay"],
                  eps=g["eps"], maximize=g["maximize"], grad_scale=None, found_inf=None)
        in_c = compiled is not None and not g["amsgrad"] and not isinstance(g["lr"], torch.Tensor)
        for p in g["params"]:
            slot = slot_of[p.data_ptr()]
            st = optimizer.state[p]
            m, v = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
            vmax = st["max_exp_avg_sq"].view(-1) if g["amsgrad"] else None
            # torch increments the step before its kernel reads it: every tile reads the incremented value.
            step = st["step"] + 1
            hyper = adam_kernel.Hyper.of(decoupled, g["lr"], beta1, beta2, g["weight_decay"], g["eps"],
                                         g["maximize"], float(st["step"]) + 1) if in_c else None
            for k, (a, b) in enumerate(_tiles(slot.numel, tile if hyper is None else _compiled_tile(slot.numel, threads,
                                                                                                 tile))):
                # The compiled loop takes whole 64-element blocks; the parameter's last numel % 64 (where torch's
                # scalar tail may run) stay with torch's kernel.
                c = a + (b - a) // adam_kernel.ALIGN * adam_kernel.ALIGN if hyper is not None else a
                if c > a:
                    jobs.append((slot.offset + a, slot.offset + c, None, (m[a:c], v[a:c]), hyper))
                    share.append(k)
                if b > c:
                    state = ([m[c:b]], [v[c:b]], [vmax[c:b]] if vmax is not None else [], [step])
                    jobs.append((slot.offset + c, slot.offset + b, op, state, kw))
                    share.append(len(jobs))  # a tail (under 64 elements) or a torch tile: spread round the workers
            steps.append(st["step"])
            covered.append((slot.offset, slot.offset + slot.numel))

    def run(part: list[tuple]) -> list[torch.Tensor]:
        ties = []
        for a, b, op, state, kw in part:
            if op is None:
                t = _compiled_step(compiled, group, a, b, state, kw, coef_t, grad_source, old_ties)
            else:
                m, v, vmax, step = state
                grad = _load_grad(group, a, b, coefs, grad_source)
                _unpack(group, a, b, old_ties)
                op([group.work[a:b]], [grad], m, v, vmax, step, **kw)
                t = _pack(group, a, b)
            if t is not None and t.numel():
                ties.append(t + a)
        return ties

    n = max(1, min(threads or team(), len(jobs)))
    if n == 1:
        new_ties = run(jobs)
    else:
        if compiled is not None:
            # Worker k takes the k-th share of every parameter: equal work, where contiguous runs of the tiles
            # could differ by a share of the largest parameter (measured 7.0M against 5.6M elements of a layer).
            parts = [[job for job, k in zip(jobs, share) if k % n == w] for w in range(n)]
        else:
            parts = _split_runs(jobs, [b - a for a, b, *_ in jobs], n)
        new_ties = [t for ts in workers(n).map(run, parts) for t in ts]
    if compiled is not None and folds:
        # The compiled loop wrote the clipped gradients back into the slab behind torch's back: bump its version
        # counter as an in-place op would, so a norm cached from the unscaled slab (slab_state.py) is not reused.
        torch.autograd.graph.increment_version(group.grad)
    torch._foreach_add_(steps, 1)  # what torch's step() leaves in the state
    if group.master_mode is HostMaster.HILO:
        # Ties of the ranges no parameter of the optimizer covers (frozen ones) stay as they were.
        keep = old_ties
        for a, b in covered if keep.numel() else ():
            keep = keep[(keep < a) | (keep >= b)]
        group.ties = torch.sort(torch.cat([keep, *new_ties])).values if new_ties or keep.numel() else keep


def _compiled_grads(group: FlatGroup, source: torch.Tensor | None) -> bool:
    """Whether the compiled loop can read this layer's gradients: an FP32 or bf16 slab, or staging."""
    g = source if source is not None else group.grad
    return g is not None and g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous()


def _compiled_step(compiled: tuple, group: FlatGroup, a: int, b: int, state: tuple[torch.Tensor, torch.Tensor],
                   hyper: adam_kernel.Hyper, coefs: torch.Tensor | None, source: torch.Tensor | None,
                   ties: torch.Tensor) -> torch.Tensor | None:
    """Elements [a, b) of the layer in the compiled loop (adam_kernel.py); the range's new ties (relative)."""
    lib, variant = compiled
    m, v = state
    grad = source[a:b] if source is not None else group.grad[a:b]
    write_back = source is None and group.grad_mode is GradSlab.FLOAT32  # (with coefs) a clip in place leaves them
    mode = group.master_mode
    if mode is HostMaster.FP32:
        kind, master, lo = adam_kernel.MASTER_FP32, group.master[a:b], None
        hi = group.shadow[a:b] if group.shadow is not None and group.owned else None
    else:
        kind = adam_kernel.MASTER_HILO if mode is HostMaster.HILO else adam_kernel.MASTER_BF16
        master, hi, lo = None, group.shadow[a:b], group.lo[a:b] if mode is HostMaster.HILO else None
    old = torch.empty(0, dtype=torch.int64)
    if mode is HostMaster.HILO and ties.numel():
        i, j = torch.searchsorted(ties, torch.tensor([a, b])).tolist()
        old = ties[i:j] - a
    new = adam_kernel.step(lib, variant, hyper, grad, None if source is not None else coefs, write_back,
                           source is not None, kind, master, hi, lo, m, v, old, 0)
    return new if mode is HostMaster.HILO else None


def _load_grad(group: FlatGroup, a: int, b: int, coefs: list[float], source: torch.Tensor | None) -> torch.Tensor:
    """The tile's FP32 gradient, clip scales applied (a bf16 slab widened into the scratch first): the store's
    own load_grads over the tile's range."""
    if source is not None:
        w = group.grad_work[a:b]
        w.copy_(source[a:b])
        return w.add_(0.0)  # 0 + g: a -0 gradient becomes +0, as added into a zeroed slab
    FlatGroup.load_grads(group.range(a, b), coefs)
    return group.grad_work[a:b]


def _unpack(group: FlatGroup, a: int, b: int, ties: torch.Tensor) -> None:
    if group.master_mode is HostMaster.HILO:
        lo_, hi_ = torch.searchsorted(ties, torch.tensor([a, b])).tolist() if ties.numel() else (0, 0)
        hilo.join(group.shadow[a:b], group.lo[a:b], ties[lo_:hi_] - a, group.work[a:b])
    elif group.master_mode is HostMaster.BF16:
        group.work[a:b].copy_(group.shadow[a:b])


def _pack(group: FlatGroup, a: int, b: int) -> torch.Tensor | None:
    """Write the tile's master back (the split, the bf16 RNE, or the FP32 master's shadow); the tile's ties."""
    work = group.work[a:b]
    if group.master_mode is HostMaster.FP32:
        if group.shadow is not None and group.owned:
            group.shadow[a:b].copy_(work)
        return None
    if group.master_mode is HostMaster.HILO:
        # The shared scratch is NaN-poisoned as it is read (see FlatGroup.pack).
        with hilo.poisoning(work) as poisoned:
            ties = hilo.split(work, group.shadow[a:b], group.lo[a:b])
        if not poisoned:
            work.fill_(float("nan"))
        return ties
    group.shadow[a:b].copy_(work)
    work.fill_(float("nan"))
    return None
