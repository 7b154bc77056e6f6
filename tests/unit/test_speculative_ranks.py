"""speculative_step with several data-parallel ranks: what resolve() decides (the bits of a 2-rank run are
tests/integration/test_dp_speculative.py's). Several ranks on one store, or each rank its own, speculate as one
process does ("auto" where the copies fit, True as set); nodes sharing one store speculate with True only ("auto"
stays off there: the rollback copies are the host memory the store was shared to save)."""

from __future__ import annotations

import types

import torch
from conftest import tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.config.settle import EngineFacts, settle_engine
from megatrain.engine import Engine
from megatrain.engine.update import speculative


def test_several_ranks_speculate_and_nodes_sharing_one_store_with_true_only():
    eng = Engine(tiny_model("llama", layers=2))
    cuda = torch.device("cuda")
    auto = settle_engine(EngineConfig(), EngineFacts("cuda"))[0]  # "auto" on a CUDA device: as many as fit
    layers = frozenset(range(len(eng.store.layers)))
    assert speculative.resolve(auto, cuda, eng.optimizer, eng.store, data_parallel=True) == layers
    assert speculative.resolve(EngineConfig(speculative_step=True), cuda, eng.optimizer, eng.store,
                               data_parallel=True) == layers
    across = types.SimpleNamespace(across_nodes=True, layers=eng.store.layers)  # a store nodes share (its flag)
    assert not speculative.resolve(auto, cuda, eng.optimizer, across, data_parallel=True)
    across.master_mode, across.groups = eng.store.master_mode, eng.store.groups  # what True's sizing reads
    assert speculative.resolve(EngineConfig(speculative_step=True), cuda, eng.optimizer, across,
                               data_parallel=True) == layers
