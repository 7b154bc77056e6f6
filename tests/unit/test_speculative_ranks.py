"""speculative_step with several data-parallel ranks: what resolve() decides (the bits of a 2-rank run are
tests/integration/test_dp_speculative.py's). Several ranks on one store, or each rank its own, speculate as one
process does ("auto" where the copies fit, True as set); nodes sharing one store are refused (not built for it)."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.config.settle import EngineFacts, settle_engine
from megatrain.engine import Engine
from megatrain.engine.update import speculative


def test_several_ranks_speculate_but_nodes_sharing_one_store_are_refused():
    eng = Engine(tiny_model("llama", layers=2))
    cuda = torch.device("cuda")
    auto = settle_engine(EngineConfig(), EngineFacts("cuda"))[0]  # "auto" on a CUDA device: as many as fit
    layers = frozenset(range(len(eng.store.layers)))
    assert speculative.resolve(auto, cuda, eng.optimizer, eng.store, data_parallel=True) == layers
    assert speculative.resolve(EngineConfig(speculative_step=True), cuda, eng.optimizer, eng.store,
                               data_parallel=True) == layers
    across = types.SimpleNamespace(across_nodes=True, layers=eng.store.layers)  # a store nodes share (its flag)
    assert not speculative.resolve(auto, cuda, eng.optimizer, across, data_parallel=True)
    with pytest.raises(ValueError, match="nodes sharing one store"):
        speculative.resolve(EngineConfig(speculative_step=True), cuda, eng.optimizer, across, data_parallel=True)
