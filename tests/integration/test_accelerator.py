"""The Accelerate-style face: one script through the torch and megatrain backends, Accelerate's rules.

The DeepSpeed ZeRO-3 backend runs the same script in tests/integration/test_zero3.py (in subprocesses).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from accel_script import (
    TokenData,
    build_model,
    checkpoint_roundtrip,
    probe_batch,
    torch_reference,
    train,
    warmup,
)
from accelerate.data_loader import DataLoaderShard
from accelerate.scheduler import AcceleratedScheduler
from gpu_defaults import GPU_DEFAULTS, bf16_reference, deepspeed_keys
from kit import fresh_accelerate_state

from megatrain.accelerate import AcceleratedOptimizer, Accelerator
from megatrain.backend import Backend
from megatrain.config.schema import EngineConfig

LR = 1e-3


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def torch_run() -> dict[str, list[float]]:
    return torch_reference("train")


def test_torch_reference_follows_the_schedule_and_clips(torch_run):
    # The reference itself: one LR per optimizer step, taken from the warm-up lambda at sync steps
    # only, and clipping active (the pre-clip norms exceed the 1.0 threshold).
    assert len(torch_run["losses"]) == 20 and len(torch_run["lrs"]) == 10
    assert torch_run["lrs"] == pytest.approx([LR * warmup(k) for k in range(10)], rel=1e-12)
    assert min(torch_run["norms"]) > 1.0


def test_megatrain_matches_torch(torch_run):
    mt = train("megatrain")
    assert max_diff(mt["losses"], torch_run["losses"]) <= 1e-5
    assert max_diff(mt["norms"], torch_run["norms"]) <= 1e-5 * max(torch_run["norms"])
    assert mt["lrs"] == pytest.approx(torch_run["lrs"], rel=1e-12)


def test_megatrain_in_the_gpu_defaults_matches_the_bf16_reference():
    """bf16 compute, optimizer overlap, hilo through the Accelerate face: its losses and pre-clip norms
    within the bf16 reference's floor (tests/gpu_defaults.py)."""
    steps, accum = 10, 2
    mt = train("megatrain", steps=steps, accum=accum, config=deepspeed_keys(GPU_DEFAULTS))
    batches = list(torch.utils.data.DataLoader(TokenData(steps * accum * 2), batch_size=2))
    floor = bf16_reference(
        build_model(0), batches, steps, accum, clip=1.0,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup))
    assert min(floor.out[1]) > 1.0  # clipping active
    floor.check((mt["losses"], mt["norms"], {}), None)


def test_the_loss_comparison_can_fail(torch_run):
    # A run that does not train (lr 0) is far outside the parity tolerance, so passing parity means
    # the optimizer steps agree, not merely that the first forward does.
    frozen = train("torch", lr=0.0, steps=3)
    assert max_diff(frozen["losses"][2:], torch_run["losses"][2:6]) > 1e-3


def test_checkpoint_roundtrip_in_the_gpu_defaults(tmp_path):
    out = checkpoint_roundtrip("megatrain", str(tmp_path), clip=1e-6, config=deepspeed_keys(GPU_DEFAULTS))
    assert out["redo"] == out["losses"][4:]  # resume is bit-exact in bf16 + overlap + hilo too


@pytest.mark.parametrize("backend", ["torch", "megatrain"])
def test_checkpoint_roundtrip(backend, tmp_path):
    # clip 1e-6 puts Adam in the eps-dominated regime, where the clipped size of each gradient shows
    # in the update: a backend that skipped or misapplied clipping would not match.
    out = checkpoint_roundtrip(backend, str(tmp_path), clip=1e-6)
    assert out["redo"] == out["losses"][4:]  # resume is bit-exact: weights, Adam state, LR, schedule
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert abs(reloaded(**probe_batch()).loss.item() - out["model_loss"]) <= 1e-6
    if backend == "megatrain":
        assert max_diff(out["losses"], torch_reference("checkpoint", clip=1e-6)["losses"]) <= 1e-5
        assert max_diff(out["losses"], torch_reference("checkpoint", clip=1.0)["losses"]) > 1e-4


def test_gradient_checkpointing_changes_flops_not_numbers(torch_run):
    gc = train("torch", gradient_checkpointing=True, steps=3)
    assert gc["gradient_checkpointing"] is True and torch_run["gradient_checkpointing"] is False
    assert max_diff(gc["losses"], torch_run["losses"][:6]) <= 1e-6


@pytest.mark.parametrize("backend", ["torch", "megatrain"])
def test_bf16_trains_close_to_fp32(backend, torch_run):
    out = train(backend, steps=3, config={"bf16": {"enabled": True}, "gradient_clipping": "auto"})
    diff = max_diff(out["losses"], torch_run["losses"][:6])
    assert 0 < diff <= 0.05, diff  # not identical: bf16 compute really ran


# -- prepare ----------------------------------------------------------------------------------------


def _objects(backend: str = "torch"):
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    loader = torch.utils.data.DataLoader(list(range(6)), batch_size=2)
    return Accelerator(backend=backend), model, opt, sched, loader


@pytest.mark.parametrize("backend", ["torch", "megatrain"])
def test_prepare_returns_the_same_order(backend):
    acc, model, opt, sched, loader = _objects(backend)
    marker = object()
    out = acc.prepare(sched, loader, marker, opt, model)
    assert isinstance(out, tuple) and len(out) == 5
    assert isinstance(out[0], AcceleratedScheduler) and out[0].scheduler is sched
    assert isinstance(out[1], DataLoaderShard)  # accelerate's own loader
    assert out[2] is marker  # unknown objects pass through, as in Accelerate
    assert isinstance(out[3], AcceleratedOptimizer)
    assert out[4] is model  # megatrain too: the user's model object, now backed by the engine's host store
    if backend == "megatrain":
        assert out[3].optimizer is opt  # taken over, not replaced: the scheduler still drives it
    assert isinstance(acc.backend, Backend)


def test_prepare_subsets_and_single_objects():
    acc, model, opt, sched, loader = _objects("torch")
    assert acc.prepare(model) is model  # one object in, one object out (no tuple)
    popt, psched = acc.prepare(opt, sched)
    assert popt.optimizer is opt and psched.scheduler is sched
    batches = list(acc.prepare(loader))
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]]


def test_prepare_refuses_what_cannot_work():
    acc, model, opt, sched, _ = _objects("torch")
    with pytest.raises(ValueError, match="before"):
        acc.prepare(sched)  # its optimizer was never prepared
    acc, model, opt, _, _ = _objects("megatrain")
    with pytest.raises(ValueError, match="model before"):
        acc.prepare(opt)  # the engine must exist to take the optimizer over
    with pytest.raises(ValueError, match="backend"):
        Accelerator(backend="fsdp")
    with pytest.raises(ValueError, match="mixed_precision"):
        Accelerator(backend="torch", mixed_precision="fp16")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        Accelerator(backend="torch", gradient_accumulation_steps=2, config={"gradient_accumulation_steps": 4})
    with pytest.raises(TypeError, match="config"):
        Accelerator(backend="torch", config="ds.json")


def test_config_settings_reach_the_face():
    acc = Accelerator(backend="torch", config={"gradient_accumulation_steps": 4, "bf16": {"enabled": True}})
    assert acc.gradient_accumulation_steps == 4 and acc.mixed_precision == "bf16"
    assert acc.state.mixed_precision == "bf16"  # accelerate's own state says what the backend computes in
    with pytest.raises(ValueError, match="already been initialized"):
        Accelerator(backend="torch")  # accelerate's rule: one mixed precision per process
    fresh_accelerate_state()
    acc = Accelerator(backend="megatrain", config=EngineConfig(compute_dtype="bfloat16"))
    assert acc.mixed_precision == "bf16"
    fresh_accelerate_state()
    assert acc.backend.engine_config.compute_dtype == "bfloat16"
    acc = Accelerator(backend="megatrain", config={"megatrain": {"num_buffers": 3}})
    assert acc.backend.engine_config.num_buffers == 3


# -- Accelerate's accumulation rules ----------------------------------------------------------------


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).mean()


def test_accumulate_syncs_every_n_and_at_the_end_of_the_loader():
    model = _Linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = torch.utils.data.DataLoader(torch.ones(7, 3), batch_size=1)
    acc = Accelerator(backend="torch", gradient_accumulation_steps=3)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    syncs, weights, lrs = [], [], []
    for x in loader:
        with acc.accumulate(model):
            acc.backward(model(x))
            opt.step()
            sched.step()
            opt.zero_grad()
        syncs.append(acc.sync_gradients)
        weights.append(model.lin.weight.detach().clone())
        lrs.append(opt.param_groups[0]["lr"])
    # 7 batches, 3 per step: steps after batches 3 and 6, and the short last group syncs at the end.
    assert syncs == [False, False, True, False, False, True, True]
    changed = [not torch.equal(weights[i], weights[i - 1]) for i in range(1, 7)]
    assert changed == [False, True, False, False, True, True]
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.0125])


def test_backward_divides_by_the_accumulation_steps():
    plain, scaled = _Linear(), _Linear()
    x = torch.randn(4, 3)
    plain(x).backward()
    acc = Accelerator(backend="torch", gradient_accumulation_steps=4)
    model = acc.prepare(scaled)
    with acc.accumulate(model):
        acc.backward(model(x))
    assert not acc.sync_gradients
    torch.testing.assert_close(model.lin.weight.grad, plain.lin.weight.grad / 4, rtol=0, atol=0)


def test_clip_grad_norm_returns_the_norm_before_clipping():
    model = _Linear()
    acc = Accelerator(backend="torch")
    model = acc.prepare(model)
    acc.backward(model(torch.full((2, 3), 10.0)))
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    norm = acc.clip_grad_norm_(model.parameters(), 1e-3)
    assert float(norm) == pytest.approx(float(expected))
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float(after) == pytest.approx(1e-3, rel=1e-3)


def test_config_gradient_clipping_applies_without_a_call():
    # DeepSpeed's meaning: a config's gradient_clipping clips every step (and defaults to 1.0). With
    # SGD at lr 1 the update's norm is the clipped gradient's norm.
    moved = []
    for config in (None, {"gradient_clipping": 1e-3}, {}):
        model = _Linear()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        acc = Accelerator(backend="torch", config=config)
        model, opt = acc.prepare(model, opt)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        acc.backward(model(torch.full((2, 3), 10.0)))
        norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
        opt.step()
        moved.append(float(torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)))
    assert norm > 1.0
    assert moved == pytest.approx([norm, 1e-3, 1.0], rel=1e-4)


def test_megatrain_prepared_model_looks_like_a_model():
    acc = Accelerator(backend="megatrain")
    model = build_model()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    pmodel, popt = acc.prepare(model, opt)
    assert sum(p.numel() for p in pmodel.parameters()) == n
    assert acc.unwrap_model(pmodel) is pmodel is model
    assert pmodel.training is acc.backend.engine.training
    pmodel.eval()
    assert not pmodel.training
    with torch.no_grad():
        out = pmodel(**probe_batch())
    assert out.loss is not None and torch.isfinite(out.loss)


@pytest.mark.parametrize("backend", ["torch", "megatrain"])
def test_save_model_with_tied_embeddings(backend, tmp_path):
    from conftest import tiny_model

    model = tiny_model(tied=True)
    acc = Accelerator(backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    batch = probe_batch()
    acc.backward(model(**batch).loss)
    opt.step()
    acc.save_model(model, tmp_path)
    acc.save_state(tmp_path / "state")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    model.eval()
    with torch.no_grad():
        assert reloaded(**batch).loss.item() == pytest.approx(model(**batch).loss.item(), abs=1e-6)


def test_an_optimizer_prepared_after_its_model_is_the_one_that_steps():
    """prepare(model) then prepare(optimizer): the engine built its own AdamW first; the user's optimizer must
    replace it where the step runs, not only in name (a plain SGD step is easy to tell from AdamW's)."""
    from conftest import tiny_model

    ref = tiny_model()
    mt_model = tiny_model()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(input_ids=ids, labels=ids).loss.backward()
    sgd.step()

    acc = Accelerator(backend="megatrain", cpu=True)
    model = acc.prepare(mt_model)
    default = acc.backend.engine.optimizer
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
    assert acc.backend.engine.optimizer is opt.optimizer is not default
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    acc.wait_for_everyone()
    got = dict(model.named_parameters())
    diffs = {n: (got[n].detach() - p.detach()).abs().max().item() for n, p in ref.named_parameters()}
    assert max(diffs.values()) <= 1e-5, diffs
    moved = max((p.detach() - q.detach()).abs().max().item()
                for p, q in zip(ref.parameters(), tiny_model().parameters()))
    assert moved > 1e-3  # control: the SGD step moved the weights far more than the tolerance
