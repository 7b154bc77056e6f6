"""LayeredStep.view_globals (engine/update/optim.py): the resident parameters' optimizer view, public, so the
layered update path updates them without reading LayeredStep's private state."""

from __future__ import annotations

import torch
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine


def test_view_globals_covers_exactly_the_resident_parameters_and_updates_them():
    eng = Engine(tiny_model("llama", layers=2, hidden=32), EngineConfig(device="cpu", optimizer_overlap=True))
    layered = eng.update.layered
    view = layered.view_globals()
    assert view is not None
    got = {p.data_ptr() for g in view.param_groups for p in g["params"]}
    assert got == {p.data_ptr() for p in eng.store.globals.params}
    before = eng.store.globals.master.clone()
    b = make_batches(1, seq=12)[0]
    eng.backward(eng(**b).loss)
    eng.step()
    eng.synchronize()
    assert not torch.equal(before, eng.store.globals.master)  # the path stepped the resident parameters
