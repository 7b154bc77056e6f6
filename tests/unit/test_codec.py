"""One codec per host mode, chosen once per group (engine/host/codec.py): the store's methods never test a mode,
each codec gives the bits the modes are defined by, and a bad mode is refused by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from kit import bits

from megatrain.costs.modes import GradSlab, HostMaster
from megatrain.engine.host.codec import grad_codec, master_codec
from megatrain.engine.host.store import FlatGroup, HostStore

STORE = Path(__file__).resolve().parents[2] / "megatrain" / "engine" / "host" / "store.py"
SHAPES = [("a", torch.Size([3, 5])), ("b", torch.Size([7])), ("c", torch.Size([2, 2, 3]))]
NUMEL = 15 + 7 + 12


def _mode_tests(source: str) -> list[str]:
    """Every comparison against a HostMaster / GradSlab member inside a class body of `source`."""
    found = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name)
                    and x.value.id in ("HostMaster", "GradSlab") for x in [node.left, *node.comparators]):
                found.append(f"{cls.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_store_tests_no_mode_inline():
    assert _mode_tests(STORE.read_text()) == []


def test_the_scan_finds_a_planted_mode_test():
    """Negative control: the check the store made before the codecs, put back into a method."""
    planted = "class FlatGroup:\n    def unpack(self):\n        if self.master_mode is HostMaster.HILO:\n            pass\n"
    assert len(_mode_tests(planted)) == 1


def _store(master: HostMaster, grad: GradSlab | None) -> HostStore:
    return HostStore([SHAPES, SHAPES], [("e", torch.Size([4, 3]))], None, torch.bfloat16, master, grad)


def _values(seed: int) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    x[3] = 1.0 + 2.0 ** -7 + 2.0 ** -8  # an exact tie with an odd upper half: RNE rounds up, a hilo tie position
    x[4] = float("inf")
    return x


@pytest.mark.parametrize("master", list(HostMaster))
def test_each_master_codec_holds_what_its_mode_defines(master):
    store = _store(master, GradSlab.FLOAT32)
    g = store.layers[0]
    assert g.masters is master_codec(master) and g.master_mode is master
    x = _values(0)
    for s in g.slots:
        g.write_slot(s, x[s.offset: s.offset + s.numel].view(s.shape))
    g.refresh_shadow()
    back = torch.cat([g.read_slot(s).reshape(-1) for s in g.slots])
    want = x if master.exact else x.to(torch.bfloat16).float()  # bf16: the master is the RNE of the value
    assert torch.equal(bits(back), bits(want))
    assert g.stream_source.dtype == torch.bfloat16  # what streams in bf16 compute, whatever the master
    assert torch.equal(bits(g.stream_source), bits(x.to(torch.bfloat16)))
    if master is HostMaster.HILO:
        assert g.ties.tolist() == [3] and [t.dtype for t in g.master_tensors()] == [torch.bfloat16, torch.int16]
    # The update's round trip: unpack gives the FP32 values, pack stores them back bit for bit and poisons the
    # shared scratch (an FP32 master's Parameters are the master itself: never poisoned).
    g.unpack()
    assert torch.equal(bits(g.work), bits(want))
    g.pack()
    assert torch.equal(bits(torch.cat([g.read_slot(s).reshape(-1) for s in g.slots])), bits(want))
    assert bool(g.work.isnan().all()) is (master is not HostMaster.FP32)


@pytest.mark.parametrize("grad", [GradSlab.FLOAT32, GradSlab.BFLOAT16, None])
def test_each_gradient_codec_loads_fp32_gradients_with_the_pending_clip(grad):
    store = _store(HostMaster.HILO, grad)
    g = store.layers[0]
    assert g.grads is grad_codec(grad) and g.grad_mode is grad
    src = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    coefs = [0.3, 0.7]
    if grad is None:
        assert g.grad is None
        g.grad_work.copy_(src)  # the staged gradients (optimizer in backward): taken as they are
        g.load_grads(coefs)
        assert torch.equal(g.grad_work, src)
        return
    g.grad.copy_(src)
    g.link_grads()
    assert (g.params[0].grad is not None) is (grad is GradSlab.FLOAT32)  # only an FP32 slab is the .grad
    g.load_grads(coefs)
    want = src.to(getattr(torch, grad.value)).float()
    for c in coefs:  # widened first, then scaled in FP32: never rounded to bf16 after a scaling
        want.mul_(c)
    assert torch.equal(g.grad_work, want)


def test_a_range_loads_the_same_bits_as_its_group():
    """The fused pass loads a tile at a time through the same codec (FlatGroup.load_grads on a GroupRange)."""
    whole, tiled = (_store(HostMaster.BF16, GradSlab.BFLOAT16).layers[0] for _ in range(2))
    src = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole.grad.copy_(src)
    tiled.grad.copy_(src)
    whole.load_grads([0.5, 0.3])
    for a in range(0, NUMEL, 10):
        FlatGroup.load_grads(tiled.range(a, min(a + 10, NUMEL)), [0.5, 0.3])
    assert torch.equal(whole.grad_work[:NUMEL], tiled.grad_work[:NUMEL])


def test_shared_buffers_follow_the_codec():
    assert [k for k, _ in master_codec(HostMaster.HILO).shared_kinds(torch.bfloat16)] == ["shadow", "lo", "ties"]
    assert [k for k, _ in master_codec(HostMaster.FP32).shared_kinds(None)] == ["master"]
    assert [k for k, _ in master_codec(HostMaster.FP32).shared_kinds(torch.bfloat16)] == ["master", "shadow"]


def test_a_mode_without_a_codec_is_refused_by_name():
    with pytest.raises(ValueError, match="'fp16'.*'fp32', 'hilo', 'bf16'"):
        master_codec("fp16")
    with pytest.raises(ValueError, match="'float16'.*'float32', 'bfloat16' or None"):
        grad_codec("float16")

