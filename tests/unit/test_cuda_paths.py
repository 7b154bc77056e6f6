"""Choices the engine makes for a CUDA device (grouped heads expanded for the fused attention kernels, the
loss chunk sized from the device budget, no host syncs per micro-batch), each checked on the CPU by taking
the same code path with the device a parameter, and on a GPU where there is one."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megatrain.engine.layer.attention import kv_for_sdpa

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _qkv(device: str, dtype: torch.dtype, heads: int = 8, kv_heads: int = 2, seq: int = 33):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, seq, 16, generator=g).to(device, dtype).requires_grad_(True)
               for n in (heads, kv_heads, kv_heads))
    return q, k, v


def _attend(q, k, v, expand: bool):
    kk, vv, gqa = kv_for_sdpa(q, k, v, expand=expand)
    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)


def test_expanded_grouped_heads_equal_enable_gqa_forward_and_backward():
    q, k, v = _qkv("cpu", torch.float64)
    ref = _attend(q, k, v, expand=False)
    out = _attend(q, k, v, expand=True)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), g)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    # Negative control: repeating the heads in the wrong order (kv head i % kv_heads) is caught.
    bad = F.scaled_dot_product_attention(q, k.repeat(1, 4, 1, 1), v.repeat(1, 4, 1, 1), is_causal=True)
    assert not torch.allclose(bad, ref, atol=1e-3)


def test_grouped_heads_are_kept_where_the_kernels_take_them():
    q, k, v = _qkv("cpu", torch.float32)
    kk, vv, gqa = kv_for_sdpa(q, k, v)
    assert kk is k and vv is v and gqa  # the CPU kernels take grouped heads in FP32
    q1, k1, v1 = _qkv("cpu", torch.float32, heads=2)
    assert kv_for_sdpa(q1, k1, v1) == (k1, v1, False)


def test_the_memory_model_counts_expanded_heads():
    from megatrain.costs.memory import KV_EXPANDED_COPIES, LayerDims, layer_working_bytes

    d = LayerDims(hidden=1024, kv=256, intermediate=2816, numel=10**7)
    e = LayerDims(hidden=1024, kv=256, intermediate=2816, numel=10**7, kv_expanded=768)
    tiled = layer_working_bytes(e, 4096, 512, 4) - layer_working_bytes(d, 4096, 512, 4)
    assert tiled == 4096 * KV_EXPANDED_COPIES * 768 * 4
    # untiled, the attention phase grows by the expanded copies (it may or may not set the peak)
    from megatrain.costs.memory import ATTN_PHASE_H, KV_PER_TOKEN

    attn = 4096 * (ATTN_PHASE_H * 1024 + KV_PER_TOKEN * 256 + KV_EXPANDED_COPIES * 768) * 4 + 10**7 * 4
    assert layer_working_bytes(e, 4096, None, 4) >= attn


@cuda
def test_fp32_grouped_attention_runs_on_the_memory_efficient_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv("cuda", torch.float32, seq=256)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # raises if only the math kernel would do
        out = _attend(q, k, v, expand=None)
        out.sum().backward()
    ref = _attend(q.detach().double(), k.detach().double(), v.detach().double(), expand=False)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_gpu_loss_chunk_is_sized_from_the_budget_not_the_cpu_logits_cap():
    from megatrain.costs.memory import (
        MAX_DEVICE_LOSS_CHUNK,
        MIN_LOSS_CHUNK,
        auto_loss_chunk,
        loss_workspace_bytes,
    )

    t, h, v = 8192, 8192, 152064
    assert auto_loss_chunk(t, h, v, 2, None) == 256  # the CPU cap: 256 MiB of FP32 logits
    big = 140 * 2**30
    assert auto_loss_chunk(t, h, v, 2, big, logits_cap=None) == MAX_DEVICE_LOSS_CHUNK
    room = loss_workspace_bytes(t, h, v, 1024, 2)  # exactly fits 1024 tokens: halved from 4096 to it
    assert auto_loss_chunk(t, h, v, 2, room, logits_cap=None) == 1024
    assert auto_loss_chunk(t, h, v, 2, room - 1, logits_cap=None) == 512
    assert auto_loss_chunk(t, h, v, 2, 1, logits_cap=None) == MIN_LOSS_CHUNK


def test_the_planner_follows_the_gpu_loss_chunk():
    from megatrain.costs.memory import MAX_DEVICE_LOSS_CHUNK
    from megatrain.planner import plan

    gpu = plan("qwen2.5-72b", context=8192, batch=1, hardware="h200-pcie")
    cpu = plan("qwen2.5-7b", context=8192, batch=1, hardware="cpu")
    assert gpu.long_context.loss_chunk == MAX_DEVICE_LOSS_CHUNK
    assert cpu.long_context.loss_chunk == 256  # 256 MiB of FP32 logits at a 152k vocabulary


_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


def _count_reads(monkeypatch, device_type: str) -> list[str]:
    """Count host reads of tensors on `device_type` (each would be a device sync on a GPU)."""
    hits: list[str] = []
    for name in _READS:
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            if self.device.type == device_type:
                hits.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return hits


def test_batch_check_reads_device_values_back_once(monkeypatch):
    from conftest import make_batches, tiny_config

    from megatrain.engine.layer.batch import check_batch

    b = make_batches(1, seq=12)[0]
    b["position_ids"] = torch.arange(12).expand(2, 12)
    cfg = tiny_config("llama")
    hits = _count_reads(monkeypatch, "cpu")
    check_batch(cfg, b["input_ids"], b["attention_mask"], b["labels"], b["position_ids"], {})
    assert hits == ["tolist"]  # every check's value in one read (inputs on one device)
    monkeypatch.undo()
    bad = b["labels"].clone()
    bad[0, 5] = 10**6
    with pytest.raises(ValueError, match="labels contain ids outside"):
        check_batch(cfg, b["input_ids"], b["attention_mask"], bad, None, {})
    allmasked = torch.full_like(b["labels"], -100)
    allmasked[:, 0] = 3  # the first label is never predicted
    with pytest.raises(ValueError, match="every label in this batch is -100"):
        check_batch(cfg, b["input_ids"], b["attention_mask"], allmasked, None, {})


def _head(weight):
    """The loss takes the model's head module; a bias-free one over `weight`."""
    return types.SimpleNamespace(weight=weight, bias=None)


def test_the_loss_over_valid_tokens_matches_cross_entropy():
    from megatrain.engine.layer.loss import chunked_causal_lm_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 40, (2, 9), generator=g, dtype=torch.int32)
    labels[1, 4:] = -100
    want = F.cross_entropy((hidden[:, :-1] @ weight.t()).reshape(-1, 40), labels[:, 1:].reshape(-1).long())
    got = chunked_causal_lm_loss(hidden, _head(weight), labels, 4)
    assert abs(float(got) / float(want) - 1) <= 1e-6  # logits are upcast to FP32, as HF does
    small = labels.clamp_min(0).to(torch.uint8)  # an 8-bit label tensor: -100 comes from the shift alone
    small[1, 4:] = 0
    ref = F.cross_entropy((hidden[:, :-1] @ weight.t()).reshape(-1, 40), small[:, 1:].reshape(-1).long())
    assert abs(float(chunked_causal_lm_loss(hidden, _head(weight), small, 4)) / float(ref) - 1) <= 1e-6
    labels[0, 3] = -100  # negative control: one more ignored token changes the mean
    assert abs(float(chunked_causal_lm_loss(hidden, _head(weight), labels, 4)) / float(want) - 1) > 1e-6


@cuda
def test_host_labels_and_batch_checks_do_not_sync_the_device():
    from megatrain.engine.layer.loss import chunked_causal_lm_loss

    hidden = torch.randn(2, 64, 32, device="cuda", requires_grad=True)
    weight = torch.randn(100, 32, device="cuda", requires_grad=True)
    labels = torch.randint(0, 100, (2, 64))
    labels[1, 40:] = -100
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = chunked_causal_lm_loss(hidden, _head(weight), labels, 16)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item()


def test_the_planner_puts_cuda_resident_gradients_on_the_copy_and_reduce_lanes():
    from megatrain.costs.residency import Residency
    from megatrain.planner import plan
    from megatrain.planner.estimate import predicted_timeline
    from megatrain.planner.hardware import get_hardware
    from megatrain.planner.point import Point
    from megatrain.planner.step_time import globals_io as _globals_io

    # no optimizer on the device: the resident parameters' gradients go to the host (with it, resident.py keeps them)
    gpu = plan("qwen2.5-7b", context=4096, batch=1, grad_accum=2, hardware="h200-pcie", residency=Residency())
    hw = get_hardware("h200-pcie")
    point = gpu.point
    assert isinstance(point, Point)
    io = _globals_io(point, hw)
    assert gpu.time.embed_io_s == pytest.approx(io.up_s)  # only the upload is on the compute thread
    spans = predicted_timeline(point, hw)
    kinds = [(s["stream"], s["kind"]) for s in spans]
    assert kinds.count(("d2h", "head-grad")) == 2 and kinds.count(("reduce-globals", "reduce-head-grad")) == 2
    cpu = plan("qwen2.5-7b", context=1024, batch=1, hardware="cpu", dtype="bfloat16")
    cpu_spans = predicted_timeline(cpu.point, get_hardware("cpu"))
    assert not any(s["kind"] == "head-grad" for s in cpu_spans)  # a CPU device adds them on its own thread
