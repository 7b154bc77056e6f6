"""The compiled one-loop AdamW step (engine/update/adam_kernel.py) against torch's own fused AdamW kernel, bit for bit.

Each master kind (FP32 with its bf16 copy, hi/lo halves, bf16), each gradient source (FP32 slab with the clip
scales written back, bf16 slab, staged gradients read as 0 + g) and each optimizer option is compared with
torch's `_fused_adam(w)_` over whole tensors on the same values. Negative controls: the arithmetic variant this
torch build does not use, a dropped tie position and a skipped clip scale each change the bits.
"""

from __future__ import annotations

import pytest
import torch
from kit import bits, wide_range

from megatrain.engine.host import hilo
from megatrain.engine.update import adam_kernel as K

N = K.ALIGN * 100  # several of the kernel's 1024-element blocks, and one part-filled
NO_TIES = torch.empty(0, dtype=torch.int64)


@pytest.fixture(scope="module")
def compiled():
    # The test set-up has a C compiler (DeepSpeed's ops need one too): a kernel that fails to build or to match
    # torch is a failure here, not a skip; where users have none, the fused pass runs torch's kernel.
    k = K.kernel()
    assert k is not None, "the compiled AdamW did not build or did not match torch's kernel on its self-check"
    return k


def _values(n: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    x = wide_range(n, seed, spread)
    x[::97], x[1::89], x[2::101] = 0.0, -0.0, 1e-40  # zeros of both signs, a subnormal
    return x


def _torch_step(p, g, m, v, adamw, step, **hp):
    op = torch._fused_adamw_ if adamw else torch._fused_adam_
    op([p], [g], [m], [v], [], [torch.tensor(float(step))], amsgrad=False, grad_scale=None, found_inf=None, **hp)


HP = [dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.05, eps=1e-8, maximize=False),
      dict(lr=3e-2, beta1=0.3, beta2=0.999, weight_decay=0.0, eps=1e-6, maximize=True),
      dict(lr=1e-4, beta1=0.0, beta2=0.9, weight_decay=0.1, eps=1e-8, maximize=False)]


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("hp", HP, ids=["default", "beta1<0.5,maximize", "beta1=0"])
@pytest.mark.parametrize("step", [1, 1000])
def test_fp32_master_matches_torchs_kernel(compiled, adamw, hp, step):
    lib, variant = compiled
    p, g, m, v = _values(N, 0), _values(N, 1), _values(N, 2) * 1e-2, _values(N, 3).abs() * 1e-3
    ref = [p.clone(), m.clone(), v.clone()]
    _torch_step(*ref[:1], g.clone(), *ref[1:], adamw, step, **hp)
    shadow = torch.empty(N, dtype=torch.bfloat16)
    hyper = K.Hyper.of(adamw, hp["lr"], hp["beta1"], hp["beta2"], hp["weight_decay"], hp["eps"], hp["maximize"], step)
    K.step(lib, variant, hyper, g, None, False, False, K.MASTER_FP32, p, shadow, None, m, v, NO_TIES, 0)
    for a, b in zip((p, m, v), ref):
        assert torch.equal(bits(a), bits(b))
    assert torch.equal(bits(shadow), bits(ref[0].bfloat16()))  # the streamed copy: torch's RNE conversion


def _hilo(values: torch.Tensor):
    hi, lo = torch.empty(values.numel(), dtype=torch.bfloat16), torch.empty(values.numel(), dtype=torch.int16)
    ties = hilo.split(values.clone(), hi, lo)
    return hi, lo, ties


def _join(hi, lo, ties) -> torch.Tensor:
    return hilo.join(hi, lo, ties, torch.empty(hi.numel()))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_hilo_halves_with_clip_scales_match_torch(compiled, grad_dtype):
    """hi/lo in, AdamW, hi/lo out, with tie positions both read (planted ones) and found; the gradients times
    two clip scales (an FP32 slab left holding the scaled values, as a clip in place leaves it)."""
    lib, variant = compiled
    p = _values(N, 4, spread=1.0)
    p[10:400:3] = ((torch.arange(10, 400, 3) * 2 + 1) << 16 | 0x8000).to(torch.int32).view(torch.float32)[:130]
    hi, lo, ties = _hilo(p)
    assert ties.numel() > 100  # planted: upper half odd, low half 0x8000
    g = _values(N, 5).to(grad_dtype)
    m, v = _values(N, 6) * 1e-2, _values(N, 7).abs() * 1e-3
    coefs = [0.37, 0.81]
    ref_g = g.to(torch.float32, copy=True)
    for c in coefs:
        ref_g.mul_(c)
    ref = [_join(hi, lo, ties), m.clone(), v.clone()]
    _torch_step(ref[0], ref_g.clone(), ref[1], ref[2], True, 7, **HP[0])
    hyper = K.Hyper.of(True, **{k: HP[0][k] for k in ("lr", "beta1", "beta2", "weight_decay", "eps", "maximize")},
                       step=7)
    slab = g.clone()
    new = K.step(lib, variant, hyper, slab, torch.tensor(coefs), grad_dtype == torch.float32, False, K.MASTER_HILO,
                 None, hi, lo, m, v, ties, 0)
    assert torch.equal(bits(_join(hi, lo, new)), bits(ref[0]))
    ref_hi, ref_lo, ref_ties = _hilo(ref[0])
    assert torch.equal(bits(hi), bits(ref_hi)) and torch.equal(lo, ref_lo) and torch.equal(new, ref_ties)
    assert torch.equal(bits(m), bits(ref[1])) and torch.equal(bits(v), bits(ref[2]))
    if grad_dtype == torch.float32:
        assert torch.equal(bits(slab), bits(ref_g))  # the slab holds the scaled gradients
    else:
        assert torch.equal(bits(slab), bits(g))  # a bf16 slab is only read


def test_staged_gradients_and_bf16_master_match_torch(compiled):
    """The optimizer in backward's source (bf16 staging read as 0 + g) into a bf16 master (widened, RNE back)."""
    lib, variant = compiled
    p = _values(N, 8, spread=1.0).bfloat16()
    g = _values(N, 9).bfloat16()
    g[::50] = -0.0
    m, v = _values(N, 10) * 1e-2, _values(N, 11).abs() * 1e-3
    ref = [p.float(), m.clone(), v.clone()]
    _torch_step(ref[0], g.float().add_(0.0), ref[1], ref[2], True, 3, **HP[0])
    hyper = K.Hyper.of(True, **{k: HP[0][k] for k in ("lr", "beta1", "beta2", "weight_decay", "eps", "maximize")},
                       step=3)
    K.step(lib, variant, hyper, g, None, False, True, K.MASTER_BF16, None, p, None, m, v, NO_TIES, 0)
    assert torch.equal(bits(p), bits(ref[0].bfloat16()))
    assert torch.equal(bits(m), bits(ref[1])) and torch.equal(bits(v), bits(ref[2]))


def test_many_ties_are_handed_back_and_kept(compiled):
    """More new ties than one call's buffer holds: the kernel stops before a block it has no room for and is
    called on from there; with lr = 0 every value (all of them ties) must come back exactly."""
    lib, variant = compiled
    n = K.ALIGN * 400
    ups = torch.randint(0, 0x3F00, (n,), generator=torch.Generator().manual_seed(12)) * 2 + 1
    p = ((ups << 16) | 0x8000).to(torch.int32).view(torch.float32)
    hi, lo, ties = _hilo(p)
    assert ties.numel() == n > K._TIE_CAP
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = K.Hyper.of(True, 0.0, 0.9, 0.95, 0.0, 1e-8, False, 1)
    new = K.step(lib, variant, hyper, torch.zeros(n), None, False, False, K.MASTER_HILO, None, hi, lo, m, v, ties, 0)
    assert torch.equal(new, ties)
    assert torch.equal(bits(_join(hi, lo, new)), bits(p))


def test_negative_control_a_dropped_tie_is_caught(compiled):
    lib, variant = compiled
    n = K.ALIGN * 20
    ups = torch.randint(0, 0x3F00, (n,), generator=torch.Generator().manual_seed(13)) * 2 + 1
    p = ((ups << 16) | 0x8000).to(torch.int32).view(torch.float32)
    hi, lo, ties = _hilo(p)
    hyper = K.Hyper.of(True, 0.0, 0.9, 0.95, 0.0, 1e-8, False, 1)
    new = K.step(lib, variant, hyper, torch.zeros(n), None, False, False, K.MASTER_HILO, None, hi, lo,
                 torch.zeros(n), torch.zeros(n), ties[1:], 0)  # the first planted tie not passed in
    assert not torch.equal(bits(_join(hi, lo, new)), bits(p))


def test_exactly_one_arithmetic_variant_is_torchs(compiled):
    """The self-check tells the variants apart: the one it chose matches torch's kernel, the other does not (so
    a kernel that contracted differently from this torch build would be caught, not used)."""
    lib, variant = compiled
    other = K.CONTRACT if variant == 0 else 0
    assert K._matches_torch(lib, variant) and not K._matches_torch(lib, other)


def test_non_finite_values_give_torchs_results_up_to_nan_signs(compiled):
    """Infinities and NaNs in gradients and state: every non-NaN result equal in bits and every NaN where torch
    has one (which operand's NaN an FMA returns is the compiler's choice, so a NaN's sign may differ)."""
    lib, variant = compiled
    for hp in HP:
        p, g, m, v = _values(N, 14), _values(N, 15), _values(N, 16) * 1e-2, _values(N, 17).abs()
        g[::7], g[1::11], g[2::13] = float("nan"), float("inf"), -float("inf")
        p[5::19], m[6::23] = float("nan"), float("inf")
        ref = [p.clone(), m.clone(), v.clone()]
        _torch_step(ref[0], g.clone(), ref[1], ref[2], True, 5, **hp)
        hyper = K.Hyper.of(True, hp["lr"], hp["beta1"], hp["beta2"], hp["weight_decay"], hp["eps"], hp["maximize"], 5)
        K.step(lib, variant, hyper, g, None, False, False, K.MASTER_FP32, p, None, None, m, v, NO_TIES, 0)
        for a, b in zip((p, m, v), ref):
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            ok = ~torch.isnan(b)
            assert torch.equal(bits(a[ok]), bits(b[ok]))


def test_the_fused_pass_runs_the_compiled_loop_for_split_and_bf16_masters(compiled, monkeypatch):
    """Where the kernel is there the fused pass takes it for a hi/lo master (the parity tests of test_fused_pass.py
    then test it), with the parameters' tails left to torch's kernel; an FP32 master keeps torch's kernel unless a
    clip is pending on its FP32 slab (folded into the loop: scaled, written back and stepped in one pass)."""
    from test_fused_pass import MODES, _differences, _run

    kinds = []
    orig = K.step
    monkeypatch.setattr(K, "step", lambda *a, **k: (kinds.append(a[7]), orig(*a, **k))[1])
    for master, grad in MODES:
        kinds.clear()
        assert not _differences(*_run(master, grad))
        folds = grad.value == "float32"  # _run passes clip scales (COEFS)
        want = ({K.MASTER_FP32} if folds else set()) if master.value == "fp32" else {K.MASTER_HILO}
        assert set(kinds) == want, (master, grad, kinds)
    monkeypatch.setattr(K._KERNEL, "state", None)  # no compiler: torch's kernel, the same bits
    kinds.clear()
    assert not _differences(*_run(*MODES[1])) and not kinds


@pytest.mark.parametrize("bump", [True, False], ids=["as built", "negative control: no version bump"])
def test_the_clipped_slab_written_back_moves_its_version_counter(compiled, bump, monkeypatch):
    """The loop stores the clipped FP32 gradients back into the slab (what torch's clip in place leaves) behind
    torch's back; a norm cached from the slab is reused only while its version counter is unchanged
    (slab_state.py), so the fused pass bumps the counter as torch's own in-place scaling does."""
    import test_fused_pass
    from test_fused_pass import COEFS, _run

    from megatrain.costs.modes import GradSlab, HostMaster
    from megatrain.engine.update import fused

    # whole 64-element blocks only: no tail goes through torch's in-place scaling, which would bump it anyway
    monkeypatch.setattr(test_fused_pass, "SHAPES", [("a", torch.Size([64, 129])), ("b", torch.Size([4096]))])
    if not bump:
        monkeypatch.setattr(torch.autograd.graph, "increment_version", lambda t: None)
    _, _, grp, opt = _run(HostMaster.HILO, GradSlab.FLOAT32, steps=2)  # the state exists: the pass is eligible
    before = grp.grad._version
    fused.fused_update(opt, grp, COEFS)
    assert (grp.grad._version != before) is bump


def test_no_compiler_or_opt_out_leaves_torchs_kernel(monkeypatch):
    monkeypatch.setattr(K._KERNEL, "state", False)
    monkeypatch.setenv("MEGATRAIN_ADAM_KERNEL", "torch")
    assert K.kernel() is None
    monkeypatch.setattr(K._KERNEL, "state", False)
    monkeypatch.delenv("MEGATRAIN_ADAM_KERNEL")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert K.kernel() is None
