"""Host-memory modes (megatrain/costs/modes.py): what each promises is checked bit for bit against the default.

- host_master="hilo": the same compute weights and masters as the FP32 master + bf16 shadow, every step
  (accumulation, clipping, an LR schedule), and checkpoints that load across the two modes.
- host_grad_dtype="bfloat16": bit-identical to FP32 slabs with one micro-batch per step (clipping too);
  accumulation refused.
- optimizer_in_backward: bit-identical to the ordinary step (no clipping, one micro-batch); clipping,
  accumulation and a skipped step refused loudly.
- host_master="bf16": runs, is not exact, and says so (its cost is measured by experiments/studies/host_modes_study.py).
Each has a negative control that breaks the mechanism and must see a difference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import bf16_engine, train_steps

from megatrain.config.schema import EngineConfig
from megatrain.costs.modes import GradSlab, HostMaster, layer_bytes_per_param
from megatrain.engine import Engine
from megatrain.engine.host import hilo
from megatrain.engine.host.store import FlatGroup

LR = 1e-2  # large enough that every step moves the low bits of every master


def _engine(model, **cfg) -> Engine:
    return bf16_engine(model, lr=LR, **cfg)


def _train(eng: Engine, batches, steps: int, accum: int = 1, clip: float | None = None, schedule: bool = False,
           start: int = 0) -> list[float]:
    """The losses, then the pre-clip norms."""
    sched = torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lambda k: 1.0 / (1 + k)) if schedule else None
    losses, norms = train_steps(eng, batches, steps, accum=accum, clip=clip, scheduler=sched, start=start)
    return losses + norms


def _differences(a: Engine, b: Engine) -> list[str]:
    """Every parameter, optimizer state tensor and streamed layer copy that is not bit-identical."""
    sa, sb = a.state_dict(), b.state_dict()
    out = [k for k in sa if not torch.equal(sa[k], sb[k])]
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    out += [f"state {k}.{n}" for k in oa for n in ("exp_avg", "exp_avg_sq", "step")
            if not torch.equal(oa[k][n], ob[k][n])]
    out += [f"streamed layer {i}" for i, (ga, gb) in enumerate(zip(a.store.layers, b.store.layers))
            if not torch.equal(ga.stream_source, gb.stream_source)]
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


# -- exact split master ---------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_hilo_is_bit_identical_to_the_fp32_master_with_accumulation_clipping_and_a_schedule(model, overlap):
    batches = make_batches(8)
    ref, hl = _engine(model), _engine(model, host_master="hilo", optimizer_overlap=overlap)
    if overlap:
        hl._layered.stream.stall_s = 0.005  # the layer updates lag: the next forward must wait for them
    assert hl.store.layers[0].master is None and hl.store.layers[0].lo.dtype == torch.int16
    ties = []
    orig = FlatGroup.pack

    def pack(group):  # count the ties the run produced: the tie list is really exercised, not just tested
        orig(group)
        ties.append(group.ties.numel())

    a = _train(ref, batches, steps=4, accum=2, clip=0.05, schedule=True)
    FlatGroup.pack = pack
    try:
        b = _train(hl, batches, steps=4, accum=2, clip=0.05, schedule=True)
    finally:
        FlatGroup.pack = orig
    assert a == b  # losses and pre-clip norms, step by step
    assert not _differences(ref, hl)
    assert sum(ties) > 0, "no tie in the run: the tie list was not exercised"


def test_hilo_negative_control_a_remainder_one_bit_short_is_caught(model, monkeypatch):
    batches = make_batches(4)
    ref = _engine(model)
    _train(ref, batches, steps=2)
    split = hilo.split

    def lossy(x, hi, lo):  # drop the lowest bit of the remainder: masters one FP32 ulp off, half the time
        ties = split(x, hi, lo)
        lo.bitwise_and_(-2)
        return ties

    monkeypatch.setattr(hilo, "split", lossy)
    bad = _engine(model, host_master="hilo")
    _train(bad, batches, steps=2)
    assert _differences(ref, bad)


def test_checkpoints_load_across_fp32_and_hilo(model):
    batches = make_batches(6)
    for first, second in (("fp32", "hilo"), ("hilo", "fp32")):
        a = _engine(model, host_master=first)
        _train(a, batches, steps=3)
        weights, opt = a.state_dict(), copy.deepcopy(a.optimizer.state_dict())
        b = _engine(model, host_master=second)
        b.load_state_dict(weights)
        b.optimizer.load_state_dict(opt)
        assert not _differences(a, b)
        _train(a, batches, steps=3, start=3)
        _train(b, batches, steps=3, start=3)
        assert not _differences(a, b), f"{first} -> {second}"


@pytest.mark.parametrize("overlap", [False, True])  # True: the GPU's defaults (bf16, overlap, hilo)
def test_hilo_checkpoint_through_initialize_resumes_bit_exactly(model, tmp_path, overlap):
    from megatrain.deepspeed import initialize

    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
          "megatrain": {"loss_chunk_tokens": 13, "optimizer_overlap": overlap}}
    batches = make_batches(6)

    def run(mode, steps, start=0, load=None):
        cfg = copy.deepcopy(ds)
        cfg["megatrain"]["host_master"] = mode
        eng, *_ = initialize(model=copy.deepcopy(model), config=cfg)
        assert eng.engine.config.optimizer_overlap is overlap
        if overlap:
            eng.engine._layered.stream.stall_s = 0.005  # the save and the load meet layer updates still queued
        if load:
            eng.load_checkpoint(load)
        for b in batches[start: start + steps]:
            eng.backward(eng(**b).loss)
            eng.step()
        return eng

    whole = run("fp32", 6)
    half = run("fp32", 3)
    half.save_checkpoint(tmp_path)
    resumed = run("hilo", 3, start=3, load=tmp_path)
    assert resumed.engine.store.master_mode is HostMaster.HILO
    sw, sr = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(sw[k], sr[k]) for k in sw)


def test_optimizer_in_backward_through_initialize_matches_the_ordinary_step(model):
    from megatrain.config.deepspeed import DeepSpeedConfigError
    from megatrain.deepspeed import initialize

    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
          "megatrain": {"loss_chunk_tokens": 13, "host_master": "hilo"}}
    engines = []
    for oib in (False, True):
        cfg = copy.deepcopy(ds)
        cfg["megatrain"]["optimizer_in_backward"] = oib
        eng, *_ = initialize(model=copy.deepcopy(model), config=cfg)
        for b in make_batches(3):
            eng.backward(eng(**b).loss)
            eng.step()
        engines.append(eng.engine)
    assert not _differences(*engines)
    # DeepSpeed clips by default (1.0) and may accumulate: refused when the config is read, naming the fix
    for change, match in (({"gradient_clipping": 1.0}, "set 'gradient_clipping': 0"),
                          ({"gradient_accumulation_steps": 2}, "'gradient_accumulation_steps': 1")):
        cfg = {**copy.deepcopy(ds), **change}
        cfg["megatrain"]["optimizer_in_backward"] = True
        with pytest.raises(DeepSpeedConfigError, match=match):
            initialize(model=copy.deepcopy(model), config=cfg)
    cfg = {**copy.deepcopy(ds), "gradient_accumulation_steps": 2}
    cfg["megatrain"]["host_grad_dtype"] = "bfloat16"
    with pytest.raises(DeepSpeedConfigError, match="cannot sum micro-batches exactly"):
        initialize(model=copy.deepcopy(model), config=cfg)


def test_preflight_charges_the_mode():
    from megatrain.engine.host.preflight import host_preflight

    layers = [[("w", torch.Size([10, 10]))]] * 3
    need = host_preflight(layers, [torch.Size([5, 10])], torch.bfloat16, available=10**12,
                          master=HostMaster.HILO, grad=None)
    assert need["master"] == 4 * 300 + 4 * 50 and need["grad"] == 4 * 50 and "bf16_shadow" not in need
    need = host_preflight(layers, [torch.Size([5, 10])], torch.bfloat16, available=10**12)
    assert need["master"] == 4 * 350 and need["grad"] == 4 * 350 and need["bf16_shadow"] == 2 * 300


def test_layer_parameters_outside_an_update_read_as_nan_not_as_another_layers_weights(model):
    eng = _engine(model, host_master="hilo")
    _train(eng, make_batches(1), steps=1)
    handle = eng.store.layers[0].params[0]  # what the optimizer updates: a view of the shared scratch
    assert torch.isnan(handle).all()
    name = f"{eng.parts.layers_prefix}.0.{eng.store.layers[0].slots[0].name}"
    assert torch.isfinite(dict(eng.named_parameters())[name]).all()  # the engine's readers join the real values


# -- bf16 gradient slabs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("master", ["fp32", "hilo"])
def test_bf16_slabs_are_bit_identical_to_fp32_slabs_at_accumulation_one(model, master):
    batches = make_batches(4)
    ref, bf = _engine(model, host_master=master), _engine(model, host_master=master, host_grad_dtype="bfloat16")
    assert bf.store.layers[0].grad.dtype == torch.bfloat16
    assert _train(ref, batches, steps=4, clip=0.05, schedule=True) == _train(bf, batches, steps=4, clip=0.05,
                                                                              schedule=True)
    assert not _differences(ref, bf)


def test_bf16_slabs_negative_control_clipping_applied_in_bf16_is_caught(model, monkeypatch):
    batches = make_batches(3)
    ref = _engine(model)
    _train(ref, batches, steps=3, clip=0.05)

    def in_bf16(group, coefs):  # scale the bf16 slab in place (rounds), then widen
        for c in coefs:
            group.grad.mul_(c)
        group.grad_work.copy_(group.grad)

    monkeypatch.setattr(FlatGroup, "load_grads", in_bf16)
    bad = _engine(model, host_grad_dtype="bfloat16")
    _train(bad, batches, steps=3, clip=0.05)
    assert _differences(ref, bad)


def test_bf16_slabs_refuse_accumulation(model):
    eng = _engine(model, host_grad_dtype="bfloat16")
    b = make_batches(2)
    eng.backward(eng(**b[0]).loss)
    with pytest.raises(RuntimeError, match="host_grad_dtype='float32' to accumulate"):
        eng.backward(eng(**b[1]).loss)


# -- optimizer in backward ----------------------------------------------------------------------------------
@pytest.mark.parametrize("master", ["fp32", "hilo"])
def test_optimizer_in_backward_is_bit_identical_to_the_ordinary_step(model, master):
    batches = make_batches(4)
    ref = _engine(model, host_master=master)
    oib = _engine(model, host_master=master, optimizer_in_backward=True)
    oib._layered.stream.stall_s = 0.005  # updates lag behind: the next forward must wait for them
    assert all(g.grad is None for g in oib.store.layers)
    assert _train(ref, batches, steps=4, schedule=True) == _train(oib, batches, steps=4, schedule=True)
    assert not _differences(ref, oib)


def test_optimizer_in_backward_negative_control_an_update_that_does_not_wait_for_its_gradients(model, monkeypatch):
    from megatrain.engine.runtime.stream import DONE
    from megatrain.engine.update.optim import LayeredStep

    batches = make_batches(3)
    ref = _engine(model)
    _train(ref, batches, steps=3)
    submit = LayeredStep.submit
    monkeypatch.setattr(LayeredStep, "submit", lambda self, i, job, after: submit(self, i, job, DONE))
    bad = _engine(model, optimizer_in_backward=True, skip_nonfinite=False)  # stale staging: wrong, not refused
    bad.streams.d2h.stall_s = 0.02  # the gradients are staged late: an update that does not wait reads stale ones
    _train(bad, batches, steps=3)
    assert _differences(ref, bad)


def test_optimizer_in_backward_refuses_what_it_cannot_do_exactly(model):
    b = make_batches(3)
    eng = _engine(model, host_master="hilo", optimizer_in_backward=True)
    eng.backward(eng(**b[0]).loss)
    with pytest.raises(RuntimeError, match="no global gradient norm"):
        eng.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps=1"):
        eng.backward(eng(**b[1]).loss)
    with pytest.raises(RuntimeError, match="cannot discard that update"):
        eng.zero_grad()
    eng.step()
    eng.zero_grad()
    eng.backward(eng(**b[2]).loss)  # one backward per step is fine
    eng.step()


def test_optimizer_in_backward_a_nonfinite_gradient_stops_training_loudly(model):
    eng = _engine(model, optimizer_in_backward=True)
    layer0 = eng.store.layers[0]
    before = layer0.read_slot(layer0.slots[0]).clone()
    loss = eng(**make_batches(1)[0]).loss
    eng.backward(loss * float("nan"))
    with pytest.raises(FloatingPointError, match="cannot be skipped"):
        eng.step()
    assert torch.equal(layer0.read_slot(layer0.slots[0]), before)  # the failed layer was not updated with NaN
    with pytest.raises(FloatingPointError, match="load a checkpoint"):
        eng.backward(eng(**make_batches(1)[0]).loss)


# -- the paper's bf16 master ------------------------------------------------------------------------------------
def test_bf16_master_trains_close_to_but_not_bit_identical_with_fp32(model):
    batches = make_batches(4)
    ref, bf = _engine(model), _engine(model, host_master="bf16", optimizer_in_backward=True)
    a, b = _train(ref, batches, steps=4), _train(bf, batches, steps=4)
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.05
    assert not HostMaster.BF16.exact and _differences(ref, bf)
    assert all(g.stream_source.dtype == torch.bfloat16 and g.master is None for g in bf.store.layers)


# -- knobs and bytes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,match", [
    (dict(host_master="hilo", compute_dtype="float32"), "set compute_dtype='bfloat16'"),
    (dict(host_grad_dtype="bfloat16", compute_dtype="float32"), "set compute_dtype='bfloat16'"),
    (dict(host_master="fp16", compute_dtype="bfloat16"), "'fp32', 'hilo', 'bf16'"),
    (dict(optimizer_in_backward="yes"), "must be true or false"),
    (dict(optimizer_in_backward=True, optimizer_overlap=True), "set one of them"),
])
def test_bad_mode_settings_are_refused_by_name(cfg, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**cfg)


def test_non_adam_optimizers_are_refused_in_the_layer_wise_modes(model):
    with pytest.raises(ValueError, match="torch's Adam or AdamW"):
        Engine(copy.deepcopy(model), EngineConfig(compute_dtype="bfloat16", host_master="hilo"),
               optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1))


@pytest.mark.parametrize("master,grad,oib", [("fp32", "float32", False), ("hilo", "float32", False),
                                             ("hilo", "bfloat16", False), ("hilo", "float32", True),
                                             ("bf16", "bfloat16", False), ("fp32", "bfloat16", True)])
def test_store_bytes_match_the_mode_table(model, master, grad, oib):
    eng = _engine(model, host_master=master, host_grad_dtype=grad, optimizer_in_backward=oib)
    n_layer = sum(g.numel for g in eng.store.layers)
    n_glob = eng.store.globals.numel
    scratch = eng.store.scratch
    extra = 0 if scratch is None else sum(t.numel() * 4 for t in (scratch.master, scratch.grad) if t is not None)
    ties = sum(g.ties.numel() * 8 for g in eng.store.layers)
    per = layer_bytes_per_param(HostMaster(master), GradSlab(grad), oib, bf16_compute=True) - 8  # Adam: not the store
    assert eng.store.host_bytes() == per * n_layer + 8 * n_glob + extra + ties


def test_stochastic_rounding_is_unbiased_and_keeps_updates_nearest_rounding_drops():
    from megatrain.engine.host.rounding import round_stochastic

    gen = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of a bf16 ulp above 1.0: nearest rounds it away
    out = torch.empty_like(x, dtype=torch.bfloat16)
    mean = round_stochastic(x, out, gen).double().mean().item()
    assert abs(mean - (1.0 + 2**-10)) < 2e-5  # binomial sd of the mean: 2^-8 * sqrt(.25 * .75 / 2e5) = 4e-6
    assert x.to(torch.bfloat16).double().mean().item() == 1.0
    # exact bf16 values, infinities and NaN are kept as such; negative values round in magnitude
    edge = torch.tensor([1.5, -2.0, float("inf"), float("-inf"), float("nan"), -(1.0 + 2**-10)])
    r = round_stochastic(edge, torch.empty(6, dtype=torch.bfloat16), gen).float()
    assert r[:4].tolist() == [1.5, -2.0, float("inf"), float("-inf")] and torch.isnan(r[4])
    assert r[5].item() in (-1.0, -(1.0 + 2**-7))
    # negative control: the same check catches a biased rounding (truncation: no random bits added)
    trunc = (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert abs(trunc.double().mean().item() - (1.0 + 2**-10)) > 2e-5


def test_bf16_master_with_stochastic_rounding_trains_and_repeats_exactly(model):
    batches = make_batches(3)
    a = _engine(model, host_master="bf16", bf16_rounding="stochastic")
    b = _engine(model, host_master="bf16", bf16_rounding="stochastic")
    assert _train(a, batches, steps=3) == _train(b, batches, steps=3)
    assert not _differences(a, b)
    with pytest.raises(ValueError, match="set host_master='bf16'"):
        EngineConfig(compute_dtype="bfloat16", host_master="hilo", bf16_rounding="stochastic")


EXIT_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import make_batches, tiny_model
from megatrain.config import EngineConfig
from megatrain.engine import Engine
eng = Engine(tiny_model(layers=3, hidden=256), EngineConfig(compute_dtype="bfloat16", {knobs}))
eng.backward(eng(**make_batches(1)[0]).loss)
eng.step()
eng.zero_grad()  # queues each layer's zeroing on the optimizer thread; the script ends right after
"""


@pytest.mark.slow
def test_exiting_with_layer_jobs_queued_does_not_abort():
    """Before the optimizer stream was drained at exit, this aborted ("terminate called without an active
    exception", SIGABRT) in 2 of 3 runs on this machine, with hilo and with optimizer_overlap alike (the same
    optimizer thread)."""
    knobs = "host_master='hilo'"
    import subprocess
    from pathlib import Path

    from kit import start_python

    tests = str(Path(__file__).resolve().parents[1])
    code = EXIT_SCRIPT.format(tests=tests, knobs=knobs)
    # The two runs side by side (each is mostly the interpreter's single-threaded start-up).
    procs = [start_python(["-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 and "terminate" not in err, err[-2000:]
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.parametrize("master", ["hilo", "bf16"])
def test_model_object_serves_the_joined_masters_not_the_scratch(master, tmp_path):
    # The layer Parameters are the shared NaN-poisoned scratch in these modes: the model object's weight
    # reads go through the host store (engine.state_dict()'s values), never the scratch; writes are refused.
    from megatrain.deepspeed import zero

    model = tiny_model()
    eng = _engine(model, host_master=master)
    _train(eng, make_batches(2), 2)
    want = eng.state_dict()
    got = eng.module.state_dict()
    assert set(want) <= set(got)
    for n, t in want.items():
        assert torch.isfinite(got[n]).all(), n
        assert torch.equal(got[n].float(), t), n
    named = dict(eng.module.named_parameters())
    for n, p in named.items():
        assert torch.isfinite(p).all(), n
        if ".layers." in n:  # the resident parameters are the engine's device copies here (bf16 compute)
            assert p.dtype == torch.float32 and torch.equal(p.detach(), want[n]), n
    assert all(torch.isfinite(p).all() for p in eng.module.parameters())
    eng.module.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    for n, t in saved.items():
        if n in want:
            assert torch.equal(t.float(), want[n]), n
    layer_param = next(eng.parts.layers[0].parameters())  # the module's own handle: the scratch
    key = f"{eng.parts.layers_prefix}.0.{next(n for n, _ in eng.parts.layers[0].named_parameters())}"
    with zero.GatheredParameters([layer_param], modifier_rank=0), torch.no_grad():
        assert torch.equal(layer_param.detach(), want[key])  # inside the block: the layer's weight
        layer_param.mul_(2)
    assert torch.equal(eng.state_dict()[key], want[key] * 2)  # the write reached the host store
