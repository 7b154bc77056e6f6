"""The step's order (issue 40, item 2): every layer's update is queued on the optimizer thread before the resident
parameters (embedding, final norm, head) are updated on the caller's thread, so the two run side by side instead of
one after the other; the update's worker pool leaves the launch and copy threads their cores while it runs beside
the next forward. Bit-identity with the whole step is tests/unit/test_optimizer_overlap.py's."""

from __future__ import annotations

from conftest import make_batches
from kit import cpu_engine

import megatrain.engine.update.update as U
from megatrain.engine import Engine
from megatrain.engine.runtime.threads import RESERVED_CORES, update_threads
from megatrain.engine.update import fused


def _one_step(eng: Engine) -> None:
    eng.zero_grad()
    eng.backward(eng(**make_batches(1)[0]).loss)
    eng.step()
    eng.synchronize()


def test_layer_jobs_are_queued_before_the_resident_update(monkeypatch):
    eng = cpu_engine(3, optimizer_overlap=True)
    _one_step(eng)  # the optimizer's state exists: the next step takes the fused pass everywhere
    events: list[str] = []
    stream = eng._layered.stream
    submit = stream.submit
    monkeypatch.setattr(stream, "submit", lambda fn, after, kind, layer: (events.append(f"{kind}{layer}"),
                                                                          submit(fn, after, kind, layer))[1])
    update_group = U.update_group

    def recorded(view, group, *a, **k):
        if group is eng.store.globals:
            events.append("resident")
        return update_group(view, group, *a, **k)

    monkeypatch.setattr(U, "update_group", recorded)
    eng.zero_grad()
    events.clear()  # zero_grad's own jobs
    eng.backward(eng(**make_batches(1)[0]).loss)
    eng.step()
    eng.synchronize()
    assert events == ["adam0", "adam1", "adam2", "resident"], events


def test_the_overlapped_pool_leaves_the_launch_and_copy_threads_their_cores(monkeypatch):
    assert update_threads(True, cores=16) == 16 - RESERVED_CORES and update_threads(False, cores=16) == 16
    assert update_threads(True, cores=1) == 1  # never none
    seen: list[int | None] = []
    run = fused.fused_update
    monkeypatch.setattr(fused, "fused_update", lambda *a, **k: (seen.append(k.get("threads")), run(*a, **k))[1])
    for overlap in (True, False):
        seen.clear()
        eng = cpu_engine(3, optimizer_overlap=overlap, host_master="hilo", compute_dtype="bfloat16")  # per-layer either way
        _one_step(eng)
        _one_step(eng)
        assert seen and set(seen) == {update_threads(overlap)}, (overlap, seen)
