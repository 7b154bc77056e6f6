"""The node path's shard map and collectives (engine/parallel/collectives.py, DISTRIBUTED.md step 1): the map
covers every element of a layer once, in equal aligned pieces; on 2 and 4 gloo ranks the all-gather is the
concatenation bit for bit, the reduce-scatter the FP32 sum within its rounding bound (bit for bit where the
order cannot matter), the forced stand-in the native collective's bits, a bf16 input summed in FP32, layers of
uneven sizes padded and cut right; the node's groups follow LOCAL_WORLD_SIZE. One launch per rank count runs
every case (tests/workers/collectives_worker.py); the test judges what each rank measured."""

from __future__ import annotations

import pytest
from kit import ROOT, finish, free_port, probes, start_python, worker_env

from megatrain.costs.shards import DEFAULT_CHUNK, GRANULE, ShardMap, default_chunk, padded_numel, shard_ranges
from megatrain.engine.host.node_store import node_layout

WORKER = ROOT / "tests" / "workers" / "collectives_worker.py"
LOCAL_WORLD = 2  # ranks per "node": 2 ranks are one node, 4 ranks two nodes on this one machine
DEADLINE_S = 300  # a bound on a hang, not a speed target


# -- the shard map (no process group) ---------------------------------------------------------------------------

@pytest.mark.parametrize("numel, world, chunk, granule", [
    (0, 1, 64, 64), (1, 2, 128, 64), (7, 4, 12, 1), (1000, 2, 256, 64), (4099, 4, 12, 1),
    (4099, 8, 1024, 64), (10**6 + 3, 8, None, GRANULE), (5, 3, 9, 1)])
def test_the_map_covers_every_element_once_in_equal_pieces(numel, world, chunk, granule):
    m = ShardMap.of(numel, world, chunk, granule)
    assert m.padded % (world * granule) == 0 and 0 <= m.padded - numel < world * granule
    owner = [-1] * m.padded
    for r in range(world):
        ranges = m.ranges(r)
        assert sum(b - a for a, b in ranges) == m.shard_numel
        for a, b in ranges:
            assert a % granule == 0 and b % granule == 0
            for i in range(a, b):
                assert owner[i] == -1, f"element {i} owned by ranks {owner[i]} and {r}"
                owner[i] = r
        # The update's ranges: the same, less the padding.
        assert sum(b - a for a, b in m.owned(r)) == sum(max(0, min(b, numel) - a) for a, b in ranges)
    assert -1 not in owner
    assert sum(b - a for r in range(world) for a, b in m.owned(r)) == numel
    assert shard_ranges(numel, world, chunk, granule) == [m.ranges(r) for r in range(world)]


def test_one_chunk_is_the_contiguous_map_and_chunks_interleave():
    m = ShardMap.of(1000, 4, granule=1)  # the default chunk holds the layer: DISTRIBUTED.md section 1's map
    assert m.padded == 1000 and [m.ranges(r) for r in range(4)] == [[(250 * r, 250 * (r + 1))] for r in range(4)]
    m = ShardMap(22, 2, chunk=8, granule=1)  # chunks 8, 8, 6: rank r the r-th half of each
    assert m.chunks() == [(0, 8), (8, 8), (16, 6)]
    assert m.ranges(0) == [(0, 4), (8, 12), (16, 19)] and m.ranges(1) == [(4, 8), (12, 16), (19, 22)]
    m = ShardMap(21, 2, chunk=8, granule=1)  # padded to 22: rank 1's last element is padding
    assert m.owned(1) == [(4, 8), (12, 16), (19, 21)]


def test_the_default_chunk_splits_for_any_world():
    for world in (1, 2, 3, 6, 8, 12):
        c = default_chunk(world)
        assert c % (world * GRANULE) == 0 and DEFAULT_CHUNK - world * GRANULE < c <= DEFAULT_CHUNK
        ShardMap.of(10**8, world)  # accepted


@pytest.mark.parametrize("call, words", [
    (lambda: ShardMap(10, 4, chunk=102, granule=1), ["chunk=102", "multiple of 4"]),
    (lambda: ShardMap(10, 0, chunk=8), ["world=0"]),
    (lambda: ShardMap(-1, 2, chunk=128), ["numel=-1"]),
    (lambda: padded_numel(5, 2, granule=0), ["granule=0"]),
    (lambda: ShardMap(10, 2, chunk=128).ranges(2), ["rank=2", "world=2"])])
def test_bad_map_input_is_refused_by_name(call, words):
    with pytest.raises(ValueError) as e:
        call()
    assert all(w in str(e.value) for w in words), str(e.value)


# -- the node's layout (no process group) ------------------------------------------------------------------------

def test_node_layout_from_hosts_and_local_world_size():
    none4 = [None] * 4
    # One host, no LOCAL_WORLD_SIZE: one node. LOCAL_WORLD_SIZE=2: two nodes on the one host (the CPU's stand-in).
    assert node_layout(["a/"] * 4, none4, none4) == [[0, 1, 2, 3]]
    assert node_layout(["a/"] * 4, [2] * 4, [0, 1, 0, 1]) == [[0, 1], [2, 3]]
    assert node_layout(["a/"] * 2, [1] * 2, [0, 0]) == [[0], [1]]
    # Two agents (GROUP_RANK) or two hosts, their ranks interleaved: nodes in order of their first rank.
    assert node_layout(["a/0", "a/1", "a/0", "a/1"], [2] * 4, [0, 0, 1, 1]) == [[0, 2], [1, 3]]
    assert node_layout(["b/", "b/", "a/", "a/"], none4, none4) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("keys, lws, lrs, words", [
    (["a/"] * 4, [2, 2, 4, 4], [None] * 4, ["LOCAL_WORLD_SIZE", "[2, 4]"]),
    (["a/"] * 3, [2] * 3, [None] * 3, ["3 ranks", "LOCAL_WORLD_SIZE=2"]),
    (["a/", "a/", "b/"], [None] * 3, [None] * 3, ["different numbers", "[2, 1]"]),
    (["a/"] * 2, [None] * 2, [1, 0], ["rank 0 has LOCAL_RANK=1"])])
def test_inconsistent_launches_are_refused_by_name(keys, lws, lrs, words):
    with pytest.raises(ValueError) as e:
        node_layout(keys, lws, lrs)
    assert all(w in str(e.value) for w in words), str(e.value)


# -- 2 and 4 gloo ranks ------------------------------------------------------------------------------------------

# 4 ranks start four interpreters (tens of seconds on a loaded two-core host): with the slow tests.
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda w: f"{w}ranks")
def ranks(request, tmp_path_factory) -> list[dict]:
    """Every rank's measurements from one launch of `world` gloo ranks as 2 per node: 2 ranks under torchrun (its
    variables, LOCAL_WORLD_SIZE among them, as users launch), 4 with the variables of two torchrun nodes on this one
    machine, GROUP_RANK left out (the node path's CPU stand-in: LOCAL_WORLD_SIZE alone splits the host's ranks)."""
    world = request.param
    tmp = tmp_path_factory.mktemp(f"collectives{world}")
    if world == LOCAL_WORLD:
        logs = [tmp / "torchrun.log"]
        procs = [start_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), WORKER],
                              log=logs[0], env=worker_env(threads=1, PYTHONWARNINGS="ignore"))]
    else:
        port = free_port()
        logs = [tmp / f"rank{r}.log" for r in range(world)]
        procs = [start_python([WORKER], log=logs[r], env=worker_env(
            world_size=world, rank=r, local_rank=r % LOCAL_WORLD, port=port, threads=1, PYTHONWARNINGS="ignore",
            LOCAL_WORLD_SIZE=str(LOCAL_WORLD))) for r in range(world)]
    try:
        for p, log in zip(procs, logs):
            finish(p, timeout=DEADLINE_S, log=log)
    finally:
        for p in procs:
            p.kill()
    found = sorted((p for log in logs for p in probes(log.read_text())), key=lambda p: p["rank"])
    assert [p["rank"] for p in found] == list(range(world)) and {p["world"] for p in found} == {world}
    return found


def test_all_gather_is_the_concatenation_bit_for_bit(ranks):
    for p in ranks:
        assert p["gather_exact"] and all(p["gather_exact"].values()), (p["rank"], p["gather_exact"])
        assert len(p["gather_exact"]) == 8  # fp32 and bf16 x native and stand-in x out of and in place


def test_reduce_scatter_is_the_fp32_sum(ranks):
    world = len(ranks)
    for p in ranks:
        # Within the rounding bound of any order of world - 1 FP32 additions; a missing or doubled input is off by
        # orders of magnitude more.
        assert p["rs_err_over_bound"] <= 1.0, p
        assert p["rs_integers_bitwise"] and p["rs_in_place_bitwise"], p
        # A fixed order: the same inputs give the same bits every time, and the stand-in (an all-reduce and a
        # slice) gives the native collective's bits: gloo's reduce-scatter is that all-reduce itself.
        assert p["rs_repeats_bitwise"] and p["rs_stand_in_bitwise"], p
        if world == 2:  # two terms: every order is one sum, so the local sum bit for bit
            assert p["rs_equals_sequential_sum"], p


def test_a_bf16_input_is_summed_in_fp32(ranks):
    for p in ranks:
        # 1 + (world - 1) * 2^-8 exactly: a sum in bf16 cannot hold it (its step at 1 is 2^-7).
        assert p["bf16_small_terms_kept"] and p["bf16_out_dtype"] == "torch.float32", p
        assert p["bf16_err_over_bound"] <= 1.0 and p["bf16_input_untouched"], p


def test_layers_of_uneven_sizes_gather_and_scatter_through_the_padded_map(ranks):
    world = len(ranks)
    for p in ranks:
        assert len(p["layers"]) == 5
        for name, case in p["layers"].items():
            numel, chunk, granule = (int(x) if x != "None" else None for x in name.split("/"))
            m = ShardMap.of(numel, world, chunk, granule)
            assert case["padded"] == m.padded and case["chunks"] == len(m.chunks()), (name, case)
            for tag in ("native", "stand_in"):
                assert case[f"gather_{tag}"], (p["rank"], name, tag)
                assert case[f"rs_err_over_bound_{tag}"] <= 1.0, (p["rank"], name, tag, case)
                assert case[f"rs_padding_zero_{tag}"] and case[f"rs_input_untouched_{tag}"], (name, case)
                # The ring's bytes: the other ranks' pieces in (the FP32 layer), this rank's FP32 pieces out.
                assert case[f"gathered_bytes_{tag}"] == (world - 1) * m.shard_numel * 4, (name, case)
                assert case[f"scattered_bytes_{tag}"] == (world - 1) * m.shard_numel * 4, (name, case)
        assert any(c["chunks"] > 1 for c in p["layers"].values())  # several chunks, a shorter last one
        assert any(c["padded"] > int(n.split("/")[0]) for n, c in p["layers"].items())  # padding exercised


def test_bad_collective_input_is_refused_by_name(ranks):
    world = len(ranks)
    want = {"sizes": ["not world=", "padded_numel"], "dtype": ["dtype"], "bf16_out": ["torch.float32"],
            "map_world": [f"world={world + 1}", f"{world} ranks"]}
    for p in ranks:
        for name, words in want.items():
            msg = p["errors"][name]
            assert msg is not None and all(w in msg for w in words), (name, msg)


def test_node_groups_follow_local_world_size(ranks):
    world = len(ranks)
    nodes = [list(range(a, a + LOCAL_WORLD)) for a in range(0, world, LOCAL_WORLD)]
    for p in ranks:
        r = p["rank"]
        node = nodes[r // LOCAL_WORLD]
        assert p["nodes"] == nodes and p["node"] == r // LOCAL_WORLD and p["local"] == r % LOCAL_WORLD, p
        assert p["node_group_ranks"] == [p["local"]] * 2 and p["node_gather"] == [float(x) for x in node], p
        # A sum over each group: the gather's and the scatter's node groups, then the peers' (the same local
        # index on every node) for each, none with one node.
        peers = sum(n[p["local"]] for n in nodes) if world > LOCAL_WORLD else None
        assert p["group_rank_sums"] == [sum(node)] * 2 + [peers] * 2, p


def test_layers_stream_through_copy_gather_and_scatter_streams(ranks):
    """DISTRIBUTED.md step 2's mechanism on the engine's copy streams: shard copies on one, gathers behind them on a
    second (a layer ahead), reduce-scatters on a third at the same time, each on its own group of the node."""
    g = LOCAL_WORLD
    for p in ranks:
        s = p["streams"]
        assert s["gathered_exact"] and s["rs_err_over_bound"] <= 1.0, s
        # This rank copied at most its 1/G of every padded layer (the padding is not copied), the gather brought the
        # other (G - 1)/G and the scatter sent (G - 1)/G of it in FP32.
        assert 0 < s["h2d_bytes"] <= s["padded_bytes"] // g, s
        assert s["gathered_bytes"] == s["padded_bytes"] * (g - 1) // g, s
        assert s["scattered_bytes"] == s["padded_fp32_bytes"] * (g - 1) // g, s
    # The node's ranks together copied every byte of every layer once: one trip per layer per node.
    for a in range(0, len(ranks), g):
        node = ranks[a:a + g]
        assert sum(p["streams"]["h2d_bytes"] for p in node) == node[0]["streams"]["whole_bytes"], node
