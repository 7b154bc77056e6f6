"""optimizer_overlap: the host AdamW a layer at a time on its own thread, hidden behind the next forward.

The claim is "the same math": every check is bit-for-bit against the same engine stepping whole, with
the optimizer thread slowed so its jobs are still queued when the caller moves on (LR schedule, zero_grad,
the next forward, state reads). A negative control removes the waits and must see different weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS, bf16_reference, is_bf16
from gpu_defaults import train as train_engine
from test_engine import assert_parity, train_reference

from megatrain.config.schema import EngineConfig
from megatrain.deepspeed import initialize
from megatrain.engine import Engine
from megatrain.engine.runtime.stream import DONE

STALL_S = 0.01  # each optimizer-thread job sleeps this long first: the caller always runs ahead of it


def _pair(model, stall: float = STALL_S, mode: dict | None = None, **cfg):
    """The same engine stepping whole and layer by layer on its thread (`mode`: a config of gpu_defaults.CONFIGS,
    its overlap setting replaced by each side's)."""
    cfg.update({k: v for k, v in (mode or {}).items() if k != "optimizer_overlap"})
    whole = Engine(copy.deepcopy(model), EngineConfig(**cfg))
    layered = Engine(copy.deepcopy(model), EngineConfig(optimizer_overlap=True, **cfg))
    assert layered._layered is not None
    layered._layered.stream.stall_s = stall
    return whole, layered


def _same(a: Engine, b: Engine) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    diff = {k: (sa[k] - sb[k]).abs().max().item() for k in sa if not torch.equal(sa[k], sb[k])}
    assert not diff, f"overlapped step differs from the whole step: {diff}"
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert oa.keys() == ob.keys()
    for k in oa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa[k][name], ob[k][name]), (k, name)


@pytest.mark.parametrize("mode", CONFIGS)
@pytest.mark.parametrize("family,kw", [("llama", dict(tied=False)), ("qwen2", dict(tied=True))])
def test_bit_identical_to_the_whole_step_with_clipping_and_accumulation(family, kw, mode):
    ref = tiny_model(family, layers=3, **kw)
    whole, layered = _pair(ref, mode=mode, loss_chunk_tokens=13)
    batches = make_batches(10)
    a = train_engine(whole, batches, steps=5, accum=2, clip=0.5)
    b = train_engine(layered, batches, steps=5, accum=2, clip=0.5)
    assert a[0] == b[0] and a[1] == b[1]  # losses and pre-clip norms, step by step
    _same(whole, layered)
    # and so as close to plain PyTorch as the engine itself
    if is_bf16(mode):
        bf16_reference(ref, batches, steps=5, accum=2, clip=0.5).check(b, layered.state_dict())
    else:
        assert_parity(ref, layered, train_reference(ref, batches, steps=5, accum=2, clip=0.5), b)


def test_user_groups_and_a_schedule_stepped_while_layers_are_still_queued():
    """The LR of a step is the one at step(): a scheduler stepped right after must not leak into it."""
    model = tiny_model("llama", layers=3)

    def opt_and_sched(m):
        decay = [p for p in m.parameters() if p.dim() >= 2]
        rest = [p for p in m.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=1e-3, betas=(0.8, 0.95))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 10.0 ** -(s % 3))

    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    o1, s1 = opt_and_sched(m1)
    o2, s2 = opt_and_sched(m2)
    whole = Engine(m1, optimizer=o1)
    layered = Engine(m2, EngineConfig(optimizer_overlap=True), optimizer=o2)
    layered._layered.stream.stall_s = STALL_S
    batches = make_batches(4)
    assert train_engine(whole, batches, 4, scheduler=s1)[0] == train_engine(layered, batches, 4, scheduler=s2)[0]
    _same(whole, layered)


@pytest.mark.parametrize("mode", CONFIGS)
def test_the_users_optimizer_zero_grad_cannot_make_a_queued_update_skip_a_layer(mode):
    """torch-style loops call optimizer.zero_grad(set_to_none=True) right after step(): the main params'
    .grad become None while their layers' updates are still queued."""
    whole, layered = _pair(tiny_model("llama", layers=3), stall=0.02, mode=mode)
    batches = make_batches(3)
    losses = {}
    for eng in (whole, layered):
        losses[eng] = []
        for b in batches:
            loss = eng(**b).loss
            eng.backward(loss)
            eng.step()
            eng.optimizer.zero_grad(set_to_none=True)
            eng.zero_grad()
            losses[eng].append(loss.item())
    assert losses[whole] == losses[layered]
    _same(whole, layered)


def test_bf16_shadows_are_refreshed_on_the_optimizer_thread():
    whole, layered = _pair(tiny_model("llama", layers=3), compute_dtype="bfloat16")
    batches = make_batches(3)
    assert train_engine(whole, batches, 3)[0] == train_engine(layered, batches, 3)[0]
    _same(whole, layered)


@pytest.mark.parametrize("mode", CONFIGS)
def test_without_the_waits_the_next_forward_reads_stale_weights(mode):
    """Negative control: the per-layer waits are what makes it exact."""
    whole, racy = _pair(tiny_model("llama", layers=4), stall=0.1, mode=mode)
    n = len(racy.store.layers)
    racy.pipeline.updated, racy.pipeline.zeroed = [DONE] * n, [DONE] * n  # loads and gradient writes no longer wait
    batches = make_batches(3)
    good = train_engine(whole, batches, 3)[0]
    bad = train_engine(racy, batches, 3)[0]
    assert good[0] == bad[0]  # the first step reads the initial weights either way
    assert good[1:] != bad[1:], "removing the waits changed nothing: the test cannot see a race"


def test_the_update_runs_behind_the_next_forward():
    eng = Engine(tiny_model("llama", layers=4), EngineConfig(optimizer_overlap=True, trace=True))
    eng._layered.stream.stall_s = 0.1  # layer 3's update ends ~0.4 s in; layer 0 computes after ~0.1 s
    batches = make_batches(2)
    train_engine(eng, batches[:1], 1)
    eng.trace_log.clear()
    train_engine(eng, batches[1:], 1)  # its forward follows the first step's queued updates
    updates = {r.layer: r for r in eng.trace if r.stream == "optimizer" and r.kind == "adam"}
    loads = {}
    for r in eng.trace:
        if r.stream == "h2d" and r.kind == "load":
            loads.setdefault(r.layer, r)
    fwd = {}
    for r in eng.trace:
        if r.stream == "compute" and r.kind == "fwd":
            fwd.setdefault(r.layer, r)
    assert len(updates) == 4
    for i in range(4):
        assert loads[i].t_start >= updates[i].t_end, f"layer {i} loaded before its update finished"
    # overlap: the first layer computes while later layers are still being updated
    assert fwd[0].t_start < updates[3].t_end, (fwd[0], updates[3])
    stats = eng.collect_stats()
    assert stats["optimizer_busy_s"] > 0


def test_other_optimizers_step_whole_with_a_warning():
    model = tiny_model("llama", layers=2)
    with pytest.warns(UserWarning, match="optimizer_overlap: SGD is not torch's Adam or AdamW"):
        eng = Engine(copy.deepcopy(model), EngineConfig(optimizer_overlap=True),
                     optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1))
    assert eng._layered is None
    ref = Engine(copy.deepcopy(model), optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1))
    batches = make_batches(2)
    assert train_engine(ref, batches, 2)[0] == train_engine(eng, batches, 2)[0]


@pytest.mark.parametrize("mode", CONFIGS)
def test_deepspeed_face_with_checkpoints_between_steps(tmp_path, mode):
    """The DeepSpeed face: a checkpoint saved while layers are still queued holds the finished step,
    and training resumed from it continues exactly as the uninterrupted run."""
    bf16 = is_bf16(mode)
    cfg = {"train_batch_size": 2, "gradient_clipping": 1.0, "bf16": {"enabled": bf16},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
           "megatrain": {"optimizer_overlap": True, **({"host_master": "hilo"} if bf16 else {})}}
    model = tiny_model("llama", layers=3)
    batches = make_batches(6)

    def run(engine, bs, save_at=None):
        losses = []
        for i, b in enumerate(bs):
            loss = engine(**b).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if i == save_at:
                engine.engine._layered.stream.stall_s = STALL_S
                engine.save_checkpoint(tmp_path, tag="mid")
        return losses

    whole = initialize(model=copy.deepcopy(model), config={**cfg, "megatrain": {**cfg["megatrain"],
                                                                                 "optimizer_overlap": False}})[0]
    layered = initialize(model=copy.deepcopy(model), config=cfg)[0]
    layered.engine._layered.stream.stall_s = STALL_S
    expect = run(whole, batches)
    assert run(layered, batches, save_at=2) == expect
    resumed = initialize(model=copy.deepcopy(model), config=cfg)[0]
    resumed.load_checkpoint(tmp_path, tag="mid")
    assert run(resumed, batches[3:]) == expect[3:]
    _same(whole.engine, resumed.engine)
