"""Resume with an `offload_optimizer` DeepSpeed config is bit-identical (issue: DeepSpeedCPUAdam drifts).

accelerate swaps the script's torch AdamW for DeepSpeed's `DeepSpeedCPUAdam` when the config offloads the optimizer
(`map_pytorch_optim_to_deepspeed`, what HF Trainer runs through); MegaTrain steps torch's AdamW in its place
(megatrain/backend/exact_adam.py). The test builds the optimizer exactly as accelerate does, trains 60 steps on
a ZeRO-3 offload config, resumes a second engine from the step-20 checkpoint and compares every later step bit for
bit; the control keeps DeepSpeed's own op (the old path) and shows the resumed run drifting. The real cpu_adam op
is needed to build the object at all: JIT-built once per machine (~85 s, cached like the ZeRO-3 baseline's).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_batches, tiny_model

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

STEPS, RESUME_AT, LR = 60, 20, 1e-3
CONFIG = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
    "megatrain": {"compute_dtype": "float32"},
}


@pytest.fixture(autouse=True)
def _cpu_adam_op(monkeypatch):
    from baselines.zero3 import default_extensions_dir

    # DeepSpeed JIT-builds its op with the ninja next to this interpreter, into the cache the baseline uses.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", default_extensions_dir()))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # 100 optimizer steps of a tiny model: one thread each op, which a busy machine's cores do not contend for.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _accelerate_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """What accelerate hands deepspeed.initialize for an offload_optimizer config: DeepSpeedCPUAdam built from
    Trainer's torch AdamW (two groups, weight decay off for biases and norms as Trainer makes them)."""
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    torch_adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                    lr=LR, betas=(0.9, 0.999), eps=1e-8)
    return map_pytorch_optim_to_deepspeed(torch_adamw)


def _engine(seed: int = 0):
    import megatrain

    model = tiny_model(seed=seed, layers=2, hidden=32, vocab=128)
    optimizer = _accelerate_optimizer(model)
    assert type(optimizer).__name__ == "DeepSpeedCPUAdam" and type(optimizer).__module__.startswith("deepspeed")
    engine, opt, _, _ = megatrain.initialize(model=model, optimizer=optimizer, config=CONFIG)
    return engine, opt


def _train(engine, batches, first: int, last: int) -> dict[int, float]:
    losses = {}
    for step in range(first, last + 1):
        loss = engine(**batches[step - 1]).loss
        engine.backward(loss)
        engine.step()
        losses[step] = loss.item()
    return losses


def _full_and_resumed(tmp_path: Path) -> tuple[dict[int, float], dict[int, float], torch.optim.Optimizer, bool]:
    """(losses of the uninterrupted run, of the run resumed at step 20, the optimizer stepped, whether the two
    runs end with the same weights bit for bit)."""
    batches = make_batches(STEPS, batch=2, seq=16, vocab=128, seed=3)
    engine, opt = _engine()
    full = _train(engine, batches, 1, RESUME_AT)
    engine.save_checkpoint(tmp_path, tag="at20")
    full.update(_train(engine, batches, RESUME_AT + 1, STEPS))

    again, _ = _engine()
    again.load_checkpoint(tmp_path, tag="at20")
    assert again.global_steps == RESUME_AT
    resumed = _train(again, batches, RESUME_AT + 1, STEPS)
    a, b = engine.state_dict(), again.state_dict()
    return full, resumed, opt, a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_offload_optimizer_config_resumes_bit_identically(tmp_path):
    full, resumed, opt, same_weights = _full_and_resumed(tmp_path)
    # The engine steps torch's AdamW over the same groups (weight decay per group kept), not DeepSpeed's op.
    assert type(opt) is torch.optim.AdamW
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert all(g["lr"] == LR and g["betas"] == (0.9, 0.999) for g in opt.param_groups)
    later = range(RESUME_AT + 1, STEPS + 1)
    assert [resumed[s] for s in later] == [full[s] for s in later]  # every step, bit for bit
    assert same_weights
    # The losses move: comparing stale or misaligned steps could not pass.
    assert len({full[s] for s in later}) == len(later)


@pytest.mark.slow
def test_control_deepspeed_cpu_adam_itself_drifts_after_resume(tmp_path, monkeypatch):
    """The old path: the engine steps the DeepSpeedCPUAdam it was given. Its op recomputes beta^t with pow()
    where the uninterrupted run multiplied, so the resumed losses leave the uninterrupted ones."""
    from megatrain.backend import exact_adam

    monkeypatch.setattr(exact_adam, "exact_optimizer", lambda optimizer: (optimizer, None))
    full, resumed, opt, same_weights = _full_and_resumed(tmp_path)
    assert type(opt).__name__ == "DeepSpeedCPUAdam"
    later = range(RESUME_AT + 1, STEPS + 1)
    drift = max(abs(resumed[s] - full[s]) for s in later)
    # Measured at this size: the losses first differ at step 37 (5 of the 40 resumed steps, up to 9.5e-7);
    # the final weights differ too.
    assert drift > 0, "DeepSpeed's CPU Adam resumed bit-identically: this control no longer shows the old drift"
    assert not same_weights


def test_adam_mode_keeps_l2_decay_and_what_torch_cannot_do_is_refused():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from megatrain.backend.exact_adam import exact_optimizer

    params = [torch.nn.Parameter(torch.ones(3))]
    ds = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1, adamw_mode=False)
    exact, what = exact_optimizer(ds)
    assert type(exact) is torch.optim.Adam and not exact.param_groups[0]["decoupled_weight_decay"]
    assert exact.param_groups[0] is ds.param_groups[0]  # a schedule on either object moves the same lr
    assert what == "DeepSpeedCPUAdam(adamw_mode=False) -> torch.optim.Adam"
    plain = torch.optim.AdamW(params)
    assert exact_optimizer(plain) == (plain, None)  # anything else is stepped as given
    with pytest.raises(ValueError, match="bias_correction=False"):
        exact_optimizer(DeepSpeedCPUAdam(params, bias_correction=False))
