"""A node's ranks updating the shared store by shard allocate their own ranges of its /dev/shm files first
(engine/host/node_store.py `_reserve_by_rank`; docs/DISTRIBUTED.md section 3, NUMA): tmpfs places a page on the NUMA
node of the CPU that allocates it, and each rank's threads are on its GPU's node (runtime/numa.py), so its team's
ranges live in its socket's memory. One machine with one node here: what is checked is who allocates which pages,
in what order (every allocation before any mapping, the leader's fill of the rest last), not where the pages land."""

from __future__ import annotations

import json
import mmap

import node_touch_worker as worker
import pytest
from test_data_parallel import ROOT, Ranks

from megatrain.costs.shards import ShardMap
from megatrain.engine.host.node_store import page_ranges

WORKER = ROOT / "tests" / "workers" / "node_touch_worker.py"


def test_page_ranges_are_the_whole_pages_inside_a_ranks_ranges():
    page = 4096
    assert page_ranges(10_000, 4, [(0, 1024), (1500, 5000)], page) == [(0, 4096), (8192, 8192)]
    assert page_ranges(1100, 4, [(1024, 2048)], page) == []  # clipped to the buffer: no whole page left
    assert page_ranges(4096, 2, [(100, 2000)], page) == []  # inside one page: its neighbours' too


@pytest.mark.slow
def test_each_rank_allocates_its_own_ranges_before_anyone_maps(tmp_path):
    ranks = Ranks(2, [str(WORKER), str(tmp_path)], tmp_path)
    assert ranks.wait() == [0, 0], ranks.log(0)[-3000:] + ranks.log(1)[-3000:]
    got = [json.loads((tmp_path / f"touch{r}.json").read_text()) for r in range(2)]
    assert all(g["zero"] and g["shared"] for g in got)  # zero-filled, one memory for both ranks
    layer = "layer weights"
    sizes = [worker.NUMEL * 4, worker.NUMEL * 2]
    for r, g in enumerate(got):
        assert [list(x) for x in ShardMap.of(worker.NUMEL, 2, worker.CHUNK).owned(r)] == g["ranges"]
        own = [e for e in g["events"] if e["kind"] == "allocate" and e["what"] == layer
               and (r != 0 or e["offset"] != 0 or e["length"] < sizes[e["file"]] // mmap.PAGESIZE * mmap.PAGESIZE)]
        for f, itemsize in enumerate((4, 2)):
            want = page_ranges(worker.NUMEL, itemsize, g["ranges"])
            assert want and [(e["offset"], e["length"]) for e in own if e["file"] == f] == want, (r, f, own)
    # the two ranks' pages are disjoint: rank 0 the first half of each chunk, rank 1 the second
    starts = [{(e["file"], e["offset"]) for e in g["events"] if e["kind"] == "allocate" and e["what"] == layer}
              for g in got]
    assert (0, 16384) in starts[1] and (0, 16384) not in starts[0]
    # the leader fills the rest of each file last, once both ranks have allocated theirs; nobody maps before
    events = sorted((e for g in got for e in g["events"] if e["what"] == layer), key=lambda e: e["t"])
    fills = [e for e in got[0]["events"] if e["what"] == layer and e["kind"] == "allocate" and e["offset"] == 0
             and e["length"] >= sizes[e["file"]]]
    assert len(fills) == 2
    first_map = next(i for i, e in enumerate(events) if e["kind"] == "map")
    assert all(e["kind"] == "allocate" for e in events[:first_map])
    assert events[first_map - 1]["t"] == max(f["t"] for f in fills)
    assert all(e["kind"] == "map" for e in events[first_map:])
    # a buffer not updated by shard (the gradient staging) is allocated whole by the leader alone, as before
    staging = [[e for e in g["events"] if e["what"] == "gradient staging" and e["kind"] == "allocate"] for g in got]
    assert len(staging[0]) == 1 and staging[0][0]["offset"] == 0 and staging[1] == []
    # more than /dev/shm holds: every rank raises the error naming the fix, and no file is left behind
    assert all("--shm-size" in (g["shortfall"] or "") and g["left"] == [] for g in got), [g["shortfall"] for g in got]
