"""One gloo rank of tests/unit/test_collectives.py: runs every case of engine/parallel/collectives.py against results
it computes locally (every rank's inputs come from seeds, so each rank rebuilds the others') and prints one
`PROBE {json}` line of measurements, which the test judges. Started with the launcher's variables (kit.worker_env)."""

from __future__ import annotations

import datetime
import json
import math

import torch
import torch.distributed as dist

from megatrain.engine.parallel.collectives import (
    GRANULE,
    CollectiveStats,
    NodeGroups,
    ShardMap,
    all_gather_into,
    gather_layer,
    node_groups,
    reduce_scatter_into,
    reduce_scatter_layer,
)
from megatrain.engine.runtime.stream import DONE, CopyStream, Trace

U = 2.0**-24  # FP32's unit roundoff


def data(seed: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


def err_over_bound(got: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """The largest |got - exact| / bound over the elements: the sum's error against the exact sum (float64 of
    FP32-exact inputs) over the rounding bound of any order of world - 1 FP32 additions, gamma * sum|x|. At most
    1 for an FP32 sum in any order; a missing or doubled input is off by far more."""
    n = len(parts)
    exact = torch.stack([p.double() for p in parts]).sum(0)
    mag = torch.stack([p.double().abs() for p in parts]).sum(0)
    gamma = (n - 1) * U / (1 - (n - 1) * U)
    bound = gamma * mag
    err = (got.double() - exact).abs()
    if bool(((bound == 0) & (err > 0)).any()):
        return math.inf
    return float((err / bound.clamp_min(1e-300)).max())


def streamed_layers(ng: NodeGroups, layers: int = 6, ring: int = 2) -> dict:
    """DISTRIBUTED.md step 2's mechanism on the engine's own copy streams (threads on the CPU), without the engine:
    each layer's owned ranges copied into a ring slot on an "h2d" stream, gathered on a "gather" stream behind that
    copy (its event the slot's `loaded`), the next layer's copy and gather in flight while this one is read, and
    every layer's gradients reduce-scattered on a "scatter" stream at the same time, each stream on its own
    group. Returns what it saw: every gathered layer and every shard against local results, the bytes moved."""
    cpu, g = torch.device("cpu"), ng.local_world
    h2d, gather, scatter = (CopyStream(name, cpu, Trace(False), None, 120.0) for name in ("h2d", "gather", "scatter"))
    numels = [1000 + 333 * i for i in range(layers)]
    maps = [ShardMap.of(n, g, 2 * g * GRANULE) for n in numels]
    host = [data(700 + i, n, torch.bfloat16) for i, n in enumerate(numels)]  # the store's stream sources
    slots = [torch.full((max(m.padded for m in maps),), float("nan"), dtype=torch.bfloat16) for _ in range(ring)]
    loaded, freed = [DONE] * ring, [DONE] * ring
    shards, scattered = [], []

    def load(i: int) -> None:
        slot, m = i % ring, maps[i]

        def copy() -> int:
            moved = 0
            for a, b in m.owned(ng.local):
                slots[slot][a:b].copy_(host[i][a:b])
                moved += (b - a) * 2
            return moved

        copied = h2d.submit(copy, (freed[slot],), "load", i)
        loaded[slot] = gather.submit(lambda: _gathered(slots[slot][:m.padded], m, ng), (copied,), "gather", i)

    whole, exact = 0, True
    load(0)
    for i in range(layers):
        if i + 1 < layers:
            load(i + 1)  # the next layer's copy and gather in flight while this one is "computed"
        slot = i % ring
        loaded[slot].host_wait(120.0)
        exact &= same_bits(slots[slot][:numels[i]], host[i])
        whole += numels[i] * 2
        grads = data(800 + 10 * i + dist.get_rank(ng.scatter_group), maps[i].padded, torch.bfloat16)
        grads[numels[i]:] = 0
        out = torch.empty(maps[i].shard_numel)
        shards.append(out)
        scattered.append(scatter.submit(lambda o=out, f=grads, m=maps[i]: _scattered(o, f, m, ng), (), "scatter", i))
        slots[slot][:] = float("nan")  # the slot's next copy must bring its own bytes
        freed[slot] = DONE  # CPU compute is synchronous: the slot is free once read
    for ev in scattered:
        ev.host_wait(120.0)
    worst = 0.0
    for i, m in enumerate(maps):
        idx = torch.cat([torch.arange(a, b) for a, b in m.ranges(ng.local)])
        parts = []
        for k in range(g):
            f = data(800 + 10 * i + k, m.padded, torch.bfloat16)
            f[numels[i]:] = 0
            parts.append(f.float()[idx])
        worst = max(worst, err_over_bound(shards[i], parts))
    return {"gathered_exact": exact, "rs_err_over_bound": worst, "h2d_bytes": h2d.bytes, "whole_bytes": whole,
            "gathered_bytes": gather.bytes, "padded_bytes": sum(m.padded * 2 for m in maps),
            "scattered_bytes": scatter.bytes, "padded_fp32_bytes": sum(m.padded * 4 for m in maps)}


def _gathered(buf: torch.Tensor, m: ShardMap, ng: NodeGroups) -> int:
    stats = CollectiveStats()
    gather_layer(buf, m, ng.gather_group, stats=stats)
    return stats.gathered_bytes


def _scattered(out: torch.Tensor, flat: torch.Tensor, m: ShardMap, ng: NodeGroups) -> int:
    stats = CollectiveStats()
    reduce_scatter_layer(out, flat, m, ng.scatter_group, stats=stats)
    return stats.scattered_bytes


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {"rank": rank, "world": world}

    # -- all-gather: bytes moved exactly, out of place and in place, native and stand-in, FP32 and bf16
    n = 3 * GRANULE
    gather_ok = {}
    for dtype in (torch.float32, torch.bfloat16):
        want = torch.cat([data(100 + k, n, dtype) for k in range(world)])
        for stand_in in (False, True):
            got = torch.full((world * n,), float("nan"), dtype=dtype)
            all_gather_into(got, data(100 + rank, n, dtype), stand_in=stand_in)
            key = f"{str(dtype)[6:]}/{'stand_in' if stand_in else 'native'}"
            gather_ok[key + "/out_of_place"] = same_bits(got, want)
            got = torch.full((world * n,), float("nan"), dtype=dtype)
            got[rank * n:(rank + 1) * n] = data(100 + rank, n, dtype)
            all_gather_into(got, got[rank * n:(rank + 1) * n], stand_in=stand_in)
            gather_ok[key + "/in_place"] = same_bits(got, want)
    out["gather_exact"] = gather_ok

    # -- reduce-scatter of FP32: against the exact sum, repeatable, stand-in bit for bit the native one
    n = world * 1000
    parts = [data(200 + k, n) for k in range(world)]
    mine = slice(rank * n // world, (rank + 1) * n // world)
    got = {}
    for stand_in in (False, True):
        for rep in range(2):
            o = torch.empty(n // world)
            reduce_scatter_into(o, parts[rank].clone(), stand_in=stand_in)
            got[stand_in, rep] = o
    out["rs_err_over_bound"] = err_over_bound(got[False, 0], [p[mine] for p in parts])
    seq = parts[0].clone()
    for p in parts[1:]:
        seq += p
    out["rs_equals_sequential_sum"] = same_bits(got[False, 0], seq[mine])  # order-free only for 2 ranks
    out["rs_repeats_bitwise"] = same_bits(got[False, 0], got[False, 1]) and same_bits(got[True, 0], got[True, 1])
    out["rs_stand_in_bitwise"] = same_bits(got[False, 0], got[True, 0])
    # Integer values: every order sums them exactly, so the result is the local sum bit for bit.
    ints = [torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(300 + k)).float()
            for k in range(world)]
    o = torch.empty(n // world)
    reduce_scatter_into(o, ints[rank].clone())
    out["rs_integers_bitwise"] = same_bits(o, torch.stack(ints).sum(0)[mine])
    # In place: out is this rank's piece of the input.
    flat = parts[rank].clone()
    reduce_scatter_into(flat[mine], flat)
    out["rs_in_place_bitwise"] = same_bits(flat[mine], got[False, 0])

    # -- a bf16 input summed in FP32: 1 + (world - 1) * 2^-8 has no bf16 representation (bf16 sums lose it)
    n = world * GRANULE
    small = torch.full((n,), 2.0**-8, dtype=torch.bfloat16)
    o = torch.empty(n // world)
    reduce_scatter_into(o, torch.ones(n, dtype=torch.bfloat16) if rank == 0 else small)
    out["bf16_small_terms_kept"] = bool((o == 1 + (world - 1) * 2.0**-8).all())
    out["bf16_input_untouched"] = bool((small == 2.0**-8).all())
    bparts = [data(400 + k, n, torch.bfloat16) for k in range(world)]
    o = torch.empty(n // world)
    reduce_scatter_into(o, bparts[rank])
    out["bf16_err_over_bound"] = err_over_bound(o, [p.float()[rank * GRANULE:(rank + 1) * GRANULE] for p in bparts])
    out["bf16_out_dtype"] = str(o.dtype)

    # -- whole layers of uneven sizes: padding, several chunks, both paths
    layers = {}
    for numel, chunk, granule in ((1, None, GRANULE), (7, None, 1), (1000, 2 * world * GRANULE, GRANULE),
                                  (4099, 3 * world, 1), (4099, 5 * world * GRANULE, GRANULE)):
        m = ShardMap.of(numel, world, chunk, granule)
        ref = torch.zeros(m.padded)
        ref[:numel] = data(500 + numel, numel)
        case = {"padded": m.padded, "chunks": len(m.chunks())}
        for stand_in in (False, True):
            buf = torch.full((m.padded,), float("nan"))
            for a, b in m.ranges(rank):
                buf[a:b] = ref[a:b]
            stats = CollectiveStats()
            gather_layer(buf, m, stats=stats, stand_in=stand_in)
            tag = "stand_in" if stand_in else "native"
            case[f"gather_{tag}"] = same_bits(buf, ref)
            case[f"gathered_bytes_{tag}"] = stats.gathered_bytes
            flats = []
            for k in range(world):
                f = torch.zeros(m.padded, dtype=torch.bfloat16)
                f[:numel] = data(600 + 10 * numel + k, numel, torch.bfloat16)
                flats.append(f)
            before = flats[rank].clone()
            shard = torch.empty(m.shard_numel)
            reduce_scatter_layer(shard, flats[rank], m, stats=stats, stand_in=stand_in)
            idx = torch.cat([torch.arange(a, b) for a, b in m.ranges(rank)])
            case[f"rs_err_over_bound_{tag}"] = err_over_bound(shard, [f.float()[idx] for f in flats])
            case[f"rs_padding_zero_{tag}"] = bool((shard[idx >= numel] == 0).all())
            case[f"scattered_bytes_{tag}"] = stats.scattered_bytes
            case[f"rs_input_untouched_{tag}"] = same_bits(flats[rank], before)
        layers[f"{numel}/{chunk}/{granule}"] = case
    out["layers"] = layers

    # -- bad input is refused by name before any collective (no rank waits on a collective another skipped)
    errors = {}
    for name, call in (("sizes", lambda: all_gather_into(torch.empty(world * 4 + 1), torch.empty(4))),
                       ("dtype", lambda: all_gather_into(torch.empty(world * 4), torch.empty(4, dtype=torch.bfloat16))),
                       ("bf16_out", lambda: reduce_scatter_into(torch.empty(4, dtype=torch.bfloat16),
                                                                torch.empty(world * 4))),
                       ("map_world", lambda: gather_layer(torch.empty(2 * (world + 1) * GRANULE),
                                                          ShardMap.of(1, world + 1)))):
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors

    # -- the node's groups, from LOCAL_WORLD_SIZE: members, this rank's index, a sum over each group
    ng = node_groups(torch.device("cpu"), datetime.timedelta(seconds=120))
    out["nodes"], out["node"], out["local"] = ng.nodes, ng.node, ng.local
    out["node_group_ranks"] = [dist.get_rank(ng.gather_group), dist.get_rank(ng.scatter_group)]
    sums = []
    for group in (ng.gather_group, ng.scatter_group, ng.cross_gather, ng.cross_scatter):
        t = torch.tensor([float(rank)])
        if group is not None:
            dist.all_reduce(t, group=group)
        sums.append(None if group is None else float(t))
    out["group_rank_sums"] = sums
    got = torch.empty(ng.local_world)
    all_gather_into(got, torch.tensor([float(rank)]), ng.gather_group)
    out["node_gather"] = got.tolist()

    out["streams"] = streamed_layers(ng)

    print("PROBE " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
