"""The fused per-layer host pass (engine/update/fused.py) against torch's own AdamW step, bit for bit.

A layer's update runs tile by tile (clip scale, bf16-slab widening, hi/lo join, AdamW, split or shadow refresh
on one tile before the next); every master, state tensor and streamed copy must equal what one
`grad.mul_(clip); optimizer.step()` over whole tensors gives. Negative controls: a skipped clip scale, a tile
that breaks the AdamW kernel's vector alignment, and (engine level) an update that does not wait for its
layer's gradients each produce a difference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.costs.modes import GradSlab, HostMaster
from megatrain.engine import Engine
from megatrain.engine.host import hilo
from megatrain.engine.host.store import FlatGroup, Scratch
from megatrain.engine.runtime.stream import DONE, CopyStream, Trace
from megatrain.engine.update import fused

SHAPES = [("a", torch.Size([37, 129])), ("b", torch.Size([5000])), ("c", torch.Size([3, 7]))]
TILE = 1024  # small: every slot spans several tiles, and two end in a tail shorter than the vector width
COEFS = [0.37, 0.81]


def _group(master: HostMaster, grad: GradSlab, values: torch.Tensor) -> FlatGroup:
    n = values.numel()
    scratch = Scratch(n, master is not HostMaster.FP32, grad is not GradSlab.FLOAT32)
    g = FlatGroup(SHAPES, torch.bfloat16 if master is HostMaster.FP32 else None, master, grad, scratch)
    for s in g.slots:
        g.write_slot(s, values[s.offset: s.offset + s.numel].view(s.shape))
    g.refresh_shadow()
    for p, s in zip(g.params, g.slots):
        p.grad = g.view(g.grad_work, s)  # what the engine's per-layer views hold
    return g


def _run(master: HostMaster, grad: GradSlab, steps: int = 3, drop_coefs: bool = False, tile: int = TILE,
         group_kw: dict | None = None):
    """(reference params, reference state, group, its optimizer) after `steps` steps of each."""
    gen = torch.Generator().manual_seed(0)
    n = sum(s.numel() for _, s in SHAPES)
    values = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(steps)]
    if grad is GradSlab.BFLOAT16:
        grads = [x.bfloat16() for x in grads]  # what the slab holds: the reference sees the same values
    hp = dict(lr=1e-2, weight_decay=0.05, betas=(0.9, 0.95), fused=True, **(group_kw or {}))

    ref = [torch.nn.Parameter(values[s.offset: s.offset + s.numel].clone().view(s.shape))
           for s in _group(HostMaster.FP32, GradSlab.FLOAT32, values).slots]
    ref_opt = torch.optim.AdamW(ref, **hp)
    grp = _group(master, grad, values)
    opt = torch.optim.AdamW(grp.params, **hp)
    for k in range(steps):
        for p, s in zip(ref, grp.slots):
            p.grad = grads[k][s.offset: s.offset + s.numel].float().view(s.shape).clone()
            for c in COEFS:
                p.grad.mul_(c)
        ref_opt.step()
        grp.grad.copy_(grads[k])
        if k == 0:  # the first step makes the state: torch's own step, as the engine does
            assert not fused.eligible(opt, grp)
            grp.load_grads(COEFS)
            grp.unpack()
            opt.step()
            grp.pack()
        else:
            assert fused.eligible(opt, grp)
            fused.fused_update(opt, grp, [] if drop_coefs else COEFS, tile=tile)
    return ref, ref_opt, grp, opt


def _differences(ref, ref_opt, grp: FlatGroup, opt) -> list[str]:
    out = []
    for p, q, s in zip(ref, grp.params, grp.slots):
        if not torch.equal(grp.read_slot(s), p.detach()):
            out.append(f"master {s.name}")
        want = p.detach().bfloat16().view(-1)
        if not torch.equal(grp.shadow[s.offset: s.offset + s.numel], want):
            out.append(f"streamed copy {s.name}")
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if not torch.equal(ref_opt.state[p][k], opt.state[q][k]):
                out.append(f"state {s.name}.{k}")
    return out


MODES = [(HostMaster.FP32, GradSlab.FLOAT32), (HostMaster.HILO, GradSlab.FLOAT32),
         (HostMaster.HILO, GradSlab.BFLOAT16), (HostMaster.FP32, GradSlab.BFLOAT16)]


@pytest.mark.parametrize("master,grad", MODES, ids=lambda m: m.value)
def test_fused_pass_is_bit_identical_to_torchs_step(master, grad):
    assert not _differences(*_run(master, grad))


def test_fused_pass_handles_amsgrad():
    assert not _differences(*_run(HostMaster.HILO, GradSlab.FLOAT32, group_kw={"amsgrad": True}))


def test_fused_hilo_pass_gives_the_same_bits_without_a_compiler(monkeypatch):
    """The pure-torch split/join (no C compiler) in the fused pass: the same masters as the compiled kernel."""
    if hilo.kernel() is None:
        pytest.fail("the compiled hilo kernel did not build: this test compares it with the torch path")
    compiled = _run(HostMaster.HILO, GradSlab.BFLOAT16)[2]
    monkeypatch.setattr(hilo._KERNEL, "state", None)
    torch_ops = _run(HostMaster.HILO, GradSlab.BFLOAT16)[2]
    assert torch.equal(compiled.shadow, torch_ops.shadow) and torch.equal(compiled.lo, torch_ops.lo)
    assert torch.equal(compiled.ties, torch_ops.ties)


def test_negative_control_a_skipped_clip_scale_is_caught():
    assert _differences(*_run(HostMaster.HILO, GradSlab.FLOAT32, drop_coefs=True))


def test_negative_control_a_tile_off_the_vector_alignment_is_caught(monkeypatch):
    with pytest.raises(ValueError, match="multiple of"):
        _run(HostMaster.FP32, GradSlab.FLOAT32, tile=1000)
    # ... and the check is there for a reason: without it such tiles change the AdamW's bits
    monkeypatch.setattr(fused, "_ALIGN", 1)
    assert _differences(*_run(HostMaster.FP32, GradSlab.FLOAT32, tile=1001))


def test_negative_control_an_update_that_does_not_wait_for_its_gradients_is_caught():
    """The fused pass as the engine queues it: a job on the optimizer thread behind the job that lands the
    layer's gradient (here a slow one). Behind it: torch's bits; queued without the wait: it reads the slab
    before the gradient is there, and the masters differ."""
    results = []
    for wait in (True, False):
        ref, ref_opt, grp, opt = _run(HostMaster.HILO, GradSlab.FLOAT32, steps=2)
        # step 3 of both, the gradient landing on another thread
        g3 = torch.randn(grp.numel, generator=torch.Generator().manual_seed(3)) * 1e-2
        for p, s in zip(ref, grp.slots):
            p.grad = g3[s.offset: s.offset + s.numel].view(s.shape).clone()
            for c in COEFS:
                p.grad.mul_(c)
        ref_opt.step()
        grp.grad.zero_()
        trace = Trace(False)
        reducer = CopyStream("reduce", torch.device("cpu"), trace, None, 30.0)
        updater = CopyStream("optimizer", torch.device("cpu"), trace, None, 30.0)
        reducer.stall_s = 0.3
        landed = reducer.submit(lambda grp=grp, g3=g3: (grp.grad.copy_(g3), 0)[1], DONE, "grad", 0)
        done = updater.submit(lambda opt=opt, grp=grp: (fused.fused_update(opt, grp, COEFS, tile=TILE), 0)[1],
                              (landed,) if wait else (), "adam", 0)
        done.host_wait(30.0)
        landed.host_wait(30.0)
        results.append(_differences(ref, ref_opt, grp, opt))
    assert results[0] == [] and results[1]


def test_the_engine_runs_the_fused_pass_bit_identical_to_the_fp32_whole_step(monkeypatch):
    """Through the engine: the FP32 master with its bf16 shadow (stepped a layer at a time without overlap, where
    the fused pass moves fewer bytes than a whole step) and hilo with clipping and overlap both run the fused
    pass (the resident parameters too, their clip folded in), and both give the bits of torch's optimizer.step() over every master (the whole step)."""
    model = tiny_model("llama", layers=2)
    batches = make_batches(4)

    def train(eng: Engine) -> list[float]:
        out = []
        for b in batches:
            eng.backward(eng(**b).loss)
            out.append(eng.clip_grad_norm_(0.05))
            eng.step()
            eng.zero_grad()
        eng.synchronize()
        return out

    def engine(hook: bool = False, **cfg) -> Engine:
        m = copy.deepcopy(model)
        opt = None
        if hook:  # a step hook keeps torch's own optimizer.step() over every master (the whole step)
            opt = torch.optim.AdamW(m.parameters(), fused=True)
            opt.register_step_post_hook(lambda *a: None)
        return Engine(m, EngineConfig(compute_dtype="bfloat16", loss_chunk_tokens=13, **cfg), optimizer=opt)

    calls = []
    orig = fused.fused_update
    monkeypatch.setattr(fused, "fused_update", lambda *a, **k: (calls.append(1), orig(*a, **k)))
    ref = engine(hook=True)  # the reference: the whole step
    a = train(ref)
    assert not calls
    sa = ref.state_dict()
    for cfg in ({}, {"host_master": "hilo", "optimizer_overlap": True}):
        eng = engine(**cfg)
        calls.clear()  # the engine's parity probe trains engines of its own at construction
        # every step after the first (which makes Adam's state): each layer and the resident parameters
        assert train(eng) == a and len(calls) == (len(eng.store.layers) + 1) * (len(batches) - 1), cfg
        sb = eng.state_dict()
        assert all(torch.equal(v, sb[k]) for k, v in sa.items()), cfg


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_finite_finds_each_kind_in_any_tile_and_no_overflow(threads, path, dtype, monkeypatch):
    from megatrain.engine.update import adam_kernel

    if path == "compiled":
        assert adam_kernel.kernel() is not None, "the compiled kernel did not build (a C compiler is on PATH here)"
    else:
        monkeypatch.setattr(adam_kernel._KERNEL, "state", None)
    x = torch.full((5 * TILE + 17,), 3e38, dtype=dtype)  # finite, but a plain sum overflows to inf
    x[1::2] = -1e-40 if dtype == torch.float32 else -3e38  # subnormals and negatives are finite too
    assert fused.all_finite(x, tile=TILE, threads=threads)
    for bad in (float("inf"), float("-inf"), float("nan")):
        for at in (0, 3 * TILE + 5, x.numel() - 1):
            y = x.clone()
            y[at] = bad
            assert not fused.all_finite(y, tile=TILE, threads=threads), (bad, at)


def test_the_finiteness_check_leaves_fp32_gradients_as_they_are():
    """all_finite reads the optimizer in backward's staged gradients: FP32 ones (FP32 compute, or a shared store's
    averaged layer) must come out of it unchanged (a multiply in place on `.float()` of an FP32 tile zeroed them)."""
    from megatrain.engine.update import fused

    g = torch.randn(3 * fused.TILE + 5)
    kept = g.clone()
    assert fused.all_finite(g) and torch.equal(g, kept)
    g[7] = float("inf")
    assert not fused.all_finite(g) and g[7] == float("inf")
