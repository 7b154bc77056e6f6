"""One rank of the first-touch test (tests/integration/test_node_first_touch.py): the node's shared buffers of a store
updated by shard (node_store.NodeStore.buffers), made by 2 ranks, with every allocation of their /dev/shm files
(os.posix_fallocate) and every mapping recorded with the system-wide monotonic clock, so the test can order the
two processes' events. Then each rank writes its ranges and reads the other's, through the shared memory.

Run as `python tests/workers/node_touch_worker.py OUT_DIR` with torchrun's variables in the environment. Writes
OUT_DIR/touch{rank}.json.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatrain.costs.shards import ShardMap
from megatrain.engine.host import node_store

NUMEL, CHUNK = 3 * 8192 + 500, 8192  # 2 ranks: pieces of 4096 elements (4 pages of FP32, 2 of bf16), a ragged end
WHATS = {"layer weights": [(NUMEL, torch.float32), (NUMEL, torch.bfloat16)],
         "gradient staging": [(NUMEL, torch.float32)]}  # not ranged: the leader allocates it all, as before


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    node = node_store.NodeStore(rank, dist.group.WORLD, datetime.timedelta(seconds=120), 120.0)
    split = node.split_by_shard(CHUNK)
    events: list[dict] = []
    real_fallocate, real_map = os.posix_fallocate, node_store.host_buffer

    def fallocate(fd: int, offset: int, length: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        events.append({"kind": "allocate", "file": int(name.rsplit("-", 1)[1]), "offset": offset,
                       "length": length, "t": time.monotonic(), "what": current[0]})
        real_fallocate(fd, offset, length)

    def host_buffer(numel: int, dtype: torch.dtype, fd: int = -1) -> torch.Tensor:
        events.append({"kind": "map", "t": time.monotonic(), "what": current[0]})
        return real_map(numel, dtype, fd)

    os.posix_fallocate, node_store.host_buffer = fallocate, host_buffer
    current = [""]
    bufs = {}
    for what, specs in WHATS.items():
        current[0] = what
        bufs[what] = node.buffers(specs, what)
    os.posix_fallocate, node_store.host_buffer = real_fallocate, real_map

    zero = all(not t.any() for ts in bufs.values() for t in ts)
    dist.barrier()  # both have looked before either writes
    weights = bufs["layer weights"]
    for t in weights:
        for a, b in split.ranges(NUMEL):
            t[a:b] = rank + 1
    dist.barrier()
    owners = [0] * NUMEL
    for r in range(dist.get_world_size()):
        for a, b in ShardMap.of(NUMEL, dist.get_world_size(), CHUNK).owned(r):
            owners[a:b] = [r + 1] * (b - a)
    want = torch.tensor(owners, dtype=torch.float32)
    shared = all(torch.equal(t.float(), want) for t in weights)
    dist.barrier()
    shortfall, left = _shortfall(node)
    (out / f"touch{rank}.json").write_text(json.dumps({
        "events": events, "ranges": split.ranges(NUMEL), "zero": zero, "shared": shared, "shortfall": shortfall,
        "left": left}))
    dist.destroy_process_group()


def _shortfall(node: node_store.NodeStore) -> tuple[str | None, list[str]]:
    """Buffers whose every rank's range is over what /dev/shm has free (one range per rank, so tmpfs refuses each
    allocation whole, up front, allocating nothing): the error every rank raises, and the files left behind."""
    st = os.statvfs(node_store.SHM_DIR)
    unit = 2 * 64  # world x granule
    numel = ((st.f_bavail * st.f_frsize + 2**30) // 2 // unit + 1) * unit * 2  # each rank's half: free + 1 GiB
    node.split_by_shard(numel)
    token = f"{os.getppid():012x}"  # the test's process: the same on both ranks, another test's elsewhere
    real = node_store.secrets.token_hex
    node_store.secrets.token_hex = lambda n: token
    try:
        node.buffers([(numel, torch.float32)], "layer weights")
        message = None
    except MemoryError as exc:
        message = str(exc)
    finally:
        node_store.secrets.token_hex = real
    dist.barrier()
    return message, sorted(n for n in os.listdir(node_store.SHM_DIR) if n.startswith(f"megatrain-{token}"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
