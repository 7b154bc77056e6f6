"""A node's host store when nodes share one store with several ranks per node (host/node_store.py
SpanningNodeStore), built here without ranks (the node's shared buffers made locally, as one rank of a node sees
them): the other nodes' layers view one node-shared scratch per buffer kind, which host_bytes counts once (this
rank's share of it) and the pinner registers once, and speculative.resolve keeps "auto" off for it as for nodes
sharing one store with one rank per node, while True speculates every layer. The launch on gloo ranks is tests/integration/test_shared_node.py's."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.config.settle import EngineFacts, settle_engine
from megatrain.costs.pinning import mapped_bytes
from megatrain.engine import Engine
from megatrain.engine.host import node_store
from megatrain.engine.host.pinned import Pinner, host_buffer
from megatrain.engine.host.store import HostStore
from megatrain.engine.update import speculative

LAYERS, SHAPES = 6, [("w", torch.Size([64, 48])), ("b", torch.Size([64]))]  # 3,136 parameters a layer


def spanning_node(monkeypatch, node: int, local: int) -> node_store.SpanningNodeStore:
    """Rank `local` of node `node` of 2 nodes of 2 ranks, the layers cut in halves; its shared buffers local."""
    monkeypatch.setattr(node_store.NodeStore, "buffers", lambda self, specs, what: [host_buffer(n, d) for n, d in specs])
    sn = node_store.SpanningNodeStore.__new__(node_store.SpanningNodeStore)
    sn.topo = node_store.Topology(node, 2, local, 2, [[0, 1], [2, 3]])
    sn.split, sn.shm_bytes, sn.layers = None, 0, LAYERS
    sn.ranges = [(0, LAYERS // 2), (LAYERS // 2, LAYERS)]
    sn.first, sn.stop = sn.ranges[node]
    sn.owner_node_of = [n for n, (a, b) in enumerate(sn.ranges) for _ in range(a, b)]
    return sn


@pytest.mark.parametrize("shadow", [None, torch.bfloat16])
def test_the_scratch_counts_once_and_is_pinned_once(monkeypatch, shadow):
    registered: list[tuple[int, int]] = []
    pinner = Pinner(register=lambda ptr, n: registered.append((ptr, n)), unregister=lambda ptr: None)
    node = spanning_node(monkeypatch, 1, 0)
    store = HostStore([SHAPES] * LAYERS, [("e", torch.Size([16, 48]))], pinner, shadow, node=node)
    numel = sum(s.numel() for _, s in SHAPES)
    other = [g for i, g in enumerate(store.layers) if not node.node_owns(i)]
    assert len(other) == LAYERS // 2 and len({g.stream_source.untyped_storage().data_ptr() for g in other}) == 1
    # each mapping registered once: the node's 3 layers' stream sources, the scratch, the resident masters (FP32)
    ptrs = [p for p, _ in registered]
    assert len(ptrs) == len(set(ptrs)) == LAYERS // 2 + 1 + (shadow is None), registered
    assert other[0].stream_source.untyped_storage().data_ptr() in ptrs
    # host_bytes: this rank's half of the node's layers' buffers and of the scratch's (each kind once), its slabs
    # (layer 4 of the node's 3-5: layer i is local rank i mod 2's) and the resident parameters' master and slab
    per = 4 + (2 if shadow is not None else 0)  # the FP32 master, and its bf16 shadow
    scratch = mapped_bytes(numel * 4) + (mapped_bytes(numel * 2) if shadow is not None else 0)
    mine = [i for i in range(LAYERS) if node.owns(i)]
    assert mine == [4]
    want = (LAYERS // 2) * numel * per / 2 + scratch / 2 + len(mine) * numel * 4 + 2 * 16 * 48 * 4
    assert store.host_bytes() == int(want), (store.host_bytes(), want)


@pytest.mark.parametrize("flag", ["spans_nodes", "across_nodes"])
def test_speculative_auto_stays_off_and_true_runs_for_nodes_sharing_one_store(monkeypatch, flag):
    """Several ranks per node (`spans_nodes`) or one (`across_nodes`): "auto" speculates no layer (the rollback
    copies are the host memory the share was cut to save), True every layer, not refused."""
    eng = Engine(tiny_model("llama", layers=2))
    cuda = torch.device("cuda")
    auto = settle_engine(EngineConfig(), EngineFacts("cuda"))[0]  # "auto" on a CUDA device: as many as fit
    assert speculative.resolve(auto, cuda, eng.optimizer, eng.store, data_parallel=True) == {0, 1}  # (the control)
    monkeypatch.setattr(eng.store, flag, True, raising=False)  # the store's flag where the nodes share it
    assert not speculative.resolve(auto, cuda, eng.optimizer, eng.store, data_parallel=True)
    assert speculative.resolve(EngineConfig(speculative_step=True), cuda, eng.optimizer, eng.store,
                               data_parallel=True) == {0, 1}
