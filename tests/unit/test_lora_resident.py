"""PEFT's adapters are resident parameters (engine/model/layer_adapters.py, placement.py): each layer's streamed
buffer holds its base weights alone, the adapters' weights, gradients and Adam state sit with the resident
parameters. Under LoRA the base is then wholly frozen: a bf16-loaded base costs 2 bytes a parameter of host store
and streams at 2, its layers have no gradient slab and send nothing back, and the adapters' gradients are in the
clip norm and the non-finite check."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from frozen_cases import BATCHES, CLIP, LR, lora_model, reference
from kit import model_steps

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine

peft = pytest.importorskip("peft")

OUTER = "base_model.model."  # the PeftModel's names over the engine's (its inner model's)


def _streamed(model: torch.nn.Module, residency: str = "stream") -> Engine:
    return Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False, residency=residency,
                                      parity_probe=False),
                  optimizer=torch.optim.AdamW(model.parameters(), lr=LR), clip_every_step=CLIP)


def _adapter(name: str, p: torch.nn.Parameter) -> bool:
    """What PEFT added (its LoRA/DoRA weights; a modules_to_save copy of a vector) by the PeftModel's name."""
    return "lora_" in name or ("modules_to_save" in name and p.dim() <= 1)


def _counts(model: torch.nn.Module) -> dict[str, int]:
    named = list(model.named_parameters())
    adapters = [p for n, p in named if _adapter(n, p)]
    base = [(n, p) for n, p in named if not _adapter(n, p)]
    return {"base_layers": sum(p.numel() for n, p in base if ".layers." in n),
            "base_other": sum(p.numel() for n, p in base if ".layers." not in n),
            "adapters": sum(p.numel() for p in adapters), "adapter_tensors": len(adapters)}


def _train(model: torch.nn.Module, steps: int = 3, residency: str = "stream",
           before: Callable[[Engine], None] | None = None) -> tuple[list[float], Engine, dict]:
    eng = _streamed(model, residency)
    if before is not None:
        before(eng)
    losses, stats = model_steps(eng, model, BATCHES[:steps])
    return losses, eng, stats


def _bf16_lora() -> torch.nn.Module:
    """The r 8 q/v LoRA over a base loaded in bf16 (PEFT keeps its adapters in FP32)."""
    model = lora_model()
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


@pytest.mark.parametrize("residency", ["stream", "auto"])
def test_a_bf16_lora_base_costs_two_bytes_a_parameter(residency):
    """A LoRA (r 8, q/v) over a base loaded in bf16 (PEFT's adapters FP32): the host store holds the layers' base at
    2 B a parameter and nothing else for it (no FP32 master, no slab, no Adam state), the rest at what it costs as
    resident parameters (the frozen embedding, norm and head: held as loaded, 2 B; the adapters: master, slab,
    Adam m and v, 16 B; Adam's step counter per adapter tensor); streamed, every layer moves 2 B a parameter, half
    what the same values held in FP32 move; the losses are bit for bit those of the same values held in FP32. With
    residency "auto" (every layer's optimizer on a CPU device) the same: a frozen layer has nothing to update."""
    bf16 = _bf16_lora()
    fp32 = copy.deepcopy(bf16)
    for p in fp32.parameters():
        p.data = p.data.float()  # the same values, held in FP32
    c = _counts(bf16)
    got, eng, stats = _train(bf16, residency=residency)
    want, _, ref_stats = _train(fp32, residency=residency)
    if residency == "auto":
        assert stats["optimizer_resident_layers"] == len(eng.store.layers)  # control: every layer placed there
    host = stats["host_store_bytes"]
    resident = 2 * c["base_other"] + 16 * c["adapters"]
    per_param = (host - resident) / c["base_layers"]  # what each base weight of the layers costs
    slack = 8 * c["adapter_tensors"] / c["base_layers"]  # Adam's step counters
    assert 2.0 <= per_param <= 2.0 + slack, (host, c, per_param)
    assert got == want
    assert all(g.stream_source.dtype == torch.bfloat16 and g.master is None and g.grad is None
               for g in eng.store.layers)
    assert sum(g.numel for g in eng.store.layers) == c["base_layers"]  # the adapters are not in the layers
    if residency == "stream":
        assert stats["h2d_bytes"] * 2 == ref_stats["h2d_bytes"] > 0


def test_a_frozen_bf16_layer_moved_to_a_device_takes_its_weights_only():
    """Optimizer residency moving a frozen layer held as loaded onto a device (relocated here, as a GPU's fresh
    buffers would be): its bf16 weights go, nothing else is made (no FP32 master, no slab), the model object's
    parameters view them there, and training is bit for bit what it is without the move."""
    from megatrain.engine.update import resident

    moved = {}

    def move_first(eng: Engine) -> None:
        group = eng.store.layers[0]
        moved["old"], moved["values"] = group.shadow, group.shadow.clone()
        resident.move(group, torch.device("cpu"), relocate=True)

    got, eng, _ = _train(_bf16_lora(), steps=2, before=move_first)
    want, _, _ = _train(_bf16_lora(), steps=2)
    group = eng.store.layers[0]
    assert group.shadow is not moved["old"] and torch.equal(group.shadow, moved["values"])
    assert group.master is None and group.grad is None and group.shadow.dtype == torch.bfloat16
    base = eng.module.model.layers[0].mlp.down_proj.weight
    assert base.untyped_storage().data_ptr() == group.shadow.untyped_storage().data_ptr()
    assert got == want


VARIANTS = {"lora": {}, "dora": {"use_dora": True},
            "layer_saved": {"modules_to_save": ["input_layernorm", "down_proj"]}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_adapters_are_resident_and_the_base_layers_get_no_slab(variant):
    """The adapters' parameters (LoRA's A and B, DoRA's magnitudes, a modules_to_save copy of a norm) are resident:
    the model object holds the engine's resident device tensors for them and their gradients land in the resident
    slab; the layers' buffers hold the base alone: no gradient slab and nothing sent back where no base weight
    trains (the modules_to_save copy of down_proj, a weight matrix, streams with its layer and trains there). The
    clip norm is plain PEFT's over the adapters, and a non-finite adapter gradient skips the step."""
    model = lora_model(**VARIANTS[variant])
    _, ref_norms, _ = reference(model, steps=1)
    adapters = [n.removeprefix(OUTER) for n, p in model.named_parameters() if _adapter(n, p)]
    eng = _streamed(model)
    where = {s.name: k for k, s in enumerate(eng.store.globals.slots)}
    assert adapters and all(n in where for n in adapters)
    inner = model.base_model.model
    assert all(inner.get_parameter(n) is eng.placement.device_globals[where[n]] for n in adapters)
    streamed = [s.name for g in eng.store.layers for s in g.slots]
    assert not any("lora_" in n for n in streamed)
    matrix_copy = variant == "layer_saved"
    assert any("modules_to_save" in n for n in streamed) == matrix_copy  # down_proj's copy
    assert all((g.grad is None) != matrix_copy for g in eng.store.layers)

    loss = model(**BATCHES[0]).loss
    eng.backward(loss)
    assert abs(eng.clip_grad_norm_(CLIP) - ref_norms[0]) <= 1e-5 * ref_norms[0]
    group = eng.store.globals
    assert all(group.view(group.grad, group.slots[where[n]]).abs().sum() > 0 for n in adapters if "lora_B" in n)
    if not matrix_copy:
        assert eng.collect_stats()["d2h_bytes"] == 0  # no layer sends a gradient
    eng.step()
    eng.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng.backward(model(**BATCHES[1]).loss * float("nan"))
        assert eng.step() is False  # what trains: the adapters (and down_proj's copy): their gradients are checked


@pytest.mark.parametrize("tile", [None, 7], ids=["untiled", "tiled"])
def test_streamed_lora_trains_as_plain_peft(tile):
    """Every layer streamed and recomputed in backward (the engine's default keeps these tiny layers' graphs instead),
    untiled and over 7-token sequence tiles (the tiled backward differentiates the adapters too): 3 clipped steps
    within 1e-5 of plain PEFT's losses."""
    model = lora_model()
    want, _, _ = reference(model, steps=3)
    eng = Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False, residency="stream",
                                     mlp_tile_tokens=tile, parity_probe=False),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=LR), clip_every_step=CLIP)
    losses, stats = model_steps(eng, model, BATCHES[:3])
    assert stats["recomputed_layers"] > 0 and eng.pipeline.tile == tile
    assert max(abs(a - b) for a, b in zip(losses, want)) <= 1e-5, (losses, want)


def test_the_planner_prices_a_bf16_lora_base_as_the_engine_holds_it():
    """`plan --trainable lora:8` (planner/partial.py) prices the frozen base at 2 B a parameter (weights only, bf16 as
    loaded), the embedding, norms and head among them; the engine, measured on the same tiny Llama, holds exactly
    that for the base: its host store less the adapters' own state (master, slab and Adam's, which the planner puts
    on the device) is the planner's figure."""
    from megatrain.planner import plan, resolve_model
    from megatrain.planner.partial import plan_partial

    model = _bf16_lora()
    cfg = model.get_base_model().config
    _, eng, stats = _train(model, steps=1)
    adapters = [p for n, p in eng.store.named_parameters(eng.placement.parts.layers_prefix) if p.requires_grad]
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for p in adapters for t in eng.optimizer.state[p].values() if torch.is_tensor(t)}
    adapter_bytes = 8 * sum(p.numel() for p in adapters) + sum(state.values())  # FP32 master + slab, Adam's state
    pl = plan(resolve_model(cfg), context=16, batch=1, hardware="h200-pcie", dtype="bfloat16")
    priced = plan_partial(pl, "lora:8")
    assert priced.adapter_params == sum(p.numel() for p in adapters)  # control: the same adapters counted
    assert stats["host_store_bytes"] - adapter_bytes == priced.host_store_bytes == 2 * pl.point.model.param_count()


def test_with_optimizer_residency_the_adapters_state_is_the_devices():
    """Where optimizer residency places a layer (a GPU's "auto" wherever one fits), the resident group goes with it
    (update/resident.py place_globals): the adapters' FP32 master, gradient and Adam state are the device group's,
    updated there, and the run trains the streamed run's bits. (On this CPU the device is the host: the group's
    device work buffer is what is checked.)"""
    def engine(residency):
        model = lora_model()
        eng = Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False, residency=residency,
                                         parity_probe=False),
                     optimizer=torch.optim.AdamW(model.parameters(), lr=LR), clip_every_step=CLIP)
        return eng, model_steps(eng, model, BATCHES[:3])[0]

    streamed, want = engine("stream")
    placed, got = engine({"weights": 1, "optimizer": 1})
    assert not streamed.globals_on_device and placed.globals_on_device
    group = placed.store.globals
    names = {id(p): n for n, p in placed.module.named_parameters()}
    adapters = [p for p in group.params if "lora_" in names.get(id(p), "")]
    assert adapters and group.work is not None and group.grad is not None
    assert all(p.requires_grad for p in adapters)
    assert got == want


def test_an_oom_in_a_backward_keeps_the_adapters_gradients_of_the_layers_above(monkeypatch):
    """A device out-of-memory error in a layer's backward goes on from that layer (runtime/oom.py layers_backward):
    the adapters' gradients the layers above it already gave are kept, not dropped with the failed attempt, so the
    run trains the bits of the run with no error."""
    import warnings as _w

    from megatrain.engine.pipeline import schedule

    emulated = {"compute_dtype": "float32", "device_budget_bytes": 24 << 20, "link_gbps": 100.0,
                "optimizer_overlap": True, "parity_probe": False}

    def run(fail: bool):
        model = lora_model()
        eng = Engine(model, EngineConfig(**emulated), optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                     clip_every_step=CLIP)
        if fail:
            calls, grads = [], schedule.LayerPipeline._grads

            def failing(self, *args, **kwargs):
                calls.append(None)
                if len(calls) == 2:  # the second layer's backward of the first step: the top layer sent
                    raise torch.OutOfMemoryError("emulated: CUDA out of memory in a layer's backward")
                return grads(self, *args, **kwargs)

            monkeypatch.setattr(schedule.LayerPipeline, "_grads", failing)
        with _w.catch_warnings():
            _w.simplefilter("ignore")
            losses = model_steps(eng, model, BATCHES[:3])[0]
        monkeypatch.undo()
        return losses, [v.clone() for v in eng.state_dict().values()]

    got, want = run(True), run(False)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
