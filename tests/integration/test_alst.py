"""The `zero3-alst` backend: DeepSpeed ZeRO-3 offload with DeepSpeed's ALST long-sequence pieces.

Proven right before it is timed: the tiled loss and tiled MLP reproduce HF's loss and gradients
(uneven tiles, padding and ignored labels included), with a negative control showing the comparison
catches a mis-weighted tiling; and through the Accelerator, DeepSpeed's run of it trains with the
same losses and gradient norms as the plain `zero3` backend.
"""

from __future__ import annotations

import copy
import json
import subprocess
import tempfile
from pathlib import Path

import deepspeed  # noqa: E402,F401 - required: the baseline is real DeepSpeed
import pytest
import torch
from conftest import tiny_model
from kit import start_python, worker_env

from baselines import alst  # noqa: E402
from megatrain.accelerate import Accelerator  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TILES = {"mlp_tile_tokens": 7, "loss_tile_tokens": 5}  # neither divides the 24-token rows: uneven last tiles


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, 10:13] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**_batch()).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worst_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in a)


def test_tiled_loss_and_mlp_reproduce_hf():
    ref = tiny_model(tied=True)
    tiled = copy.deepcopy(ref)
    tiled.tie_weights()
    assert alst.tile_mlps(tiled, TILES["mlp_tile_tokens"]) == 2
    alst.tile_loss(tiled, TILES["loss_tile_tokens"])
    ref_loss, ref_grads = _loss_and_grads(ref)
    loss, grads = _loss_and_grads(tiled)
    assert abs(loss - ref_loss) <= 1e-6
    assert _worst_rel(grads, ref_grads) <= 1e-5


def test_negative_control_per_tile_mean_is_caught():
    """DeepSpeed's docstring example (each tile's mean loss, averaged) weighs an uneven or partly ignored
    tile like a full one; the same comparison must reject it."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    model = tiny_model(tied=True)
    ref_loss, ref_grads = _loss_and_grads(model)
    model.zero_grad(set_to_none=True)
    batch = _batch()
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]

    def per_tile_mean(head, x, y):
        return torch.nn.functional.cross_entropy(head(x).float(), y, ignore_index=-100)

    shards = -(-shift.numel() // TILES["loss_tile_tokens"])
    loss = TiledFusedLogitsLoss.apply(per_tile_mean, model.lm_head, hidden, shift, None, shards,
                                      list(model.lm_head.parameters()), "mean")
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert abs(loss.item() - ref_loss) > 1e-3 or _worst_rel(grads, ref_grads) > 1e-3


def test_options_and_refusals():
    cfg, opts = alst.split_alst_options({"alst": {"mlp_tile_tokens": 64}, "zero_optimization": {"stage": 3}})
    assert "alst" not in cfg and opts == {"mlp_tile_tokens": 64, "loss_tile_tokens": None}
    assert cfg["activation_checkpointing"]["cpu_checkpointing"] is True
    with pytest.raises(ValueError, match="unknown"):
        alst.split_alst_options({"alst": {"tile": 3}})
    with pytest.raises(ValueError, match="positive int"):
        alst.split_alst_options({"alst": {"loss_tile_tokens": 0}})
    with pytest.raises(ValueError, match="gradient accumulation"):
        Accelerator(backend="zero3-alst", gradient_accumulation_steps=2)
    acc = Accelerator(backend="zero3-alst")
    assert acc.backend_name == "zero3-alst" and acc.backend.partitions_params  # DeepSpeed ZeRO-3 behind the face


def test_refuses_a_model_it_cannot_tile():
    class NotGated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = torch.nn.Identity()
            self.mlp = torch.nn.Linear(4, 4)

    with pytest.raises(TypeError, match="gated MLPs"):
        alst.tile_mlps(NotGated(), None)
    with pytest.raises(TypeError, match="no decoder layers"):
        alst.tile_mlps(torch.nn.Linear(2, 2), None)


def _launch(backend: str, out: Path, config: dict | None) -> subprocess.Popen:
    args = [str(REPO / "tests" / "workers" / "alst_worker.py"), backend, str(out)]
    return start_python(args + ([json.dumps(config)] if config else []), env=worker_env(path=[REPO / "tests"]),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_alst_trains_like_zero3():
    """Tied head (as in the benchmark's model), padding, ignored labels, clipping, uneven tiles."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"zero3": (_launch("zero3", Path(tmp) / "z.json", None), Path(tmp) / "z.json"),
                "alst": (_launch("zero3-alst", Path(tmp) / "a.json", {"alst": TILES}), Path(tmp) / "a.json")}
        res = {}
        for name, (proc, path) in runs.items():
            log, _ = proc.communicate(timeout=1200)
            if proc.returncode != 0:
                pytest.fail(f"{name} run failed (exit {proc.returncode}):\n{log[-6000:]}")
            res[name] = json.loads(path.read_text())
    z, a = res["zero3"], res["alst"]
    steps, layers = a["steps"], 2
    # The pieces really ran: one tiled loss per step, each layer's MLP tiled in forward and in its recompute,
    # each layer's checkpoint copied to the host once per step.
    assert a["tiled_loss"] == steps and a["tiled_mlp"] == 2 * layers * steps and a["host_copies"] == layers * steps
    assert len(a["losses"]) == len(z["losses"]) == steps
    assert max(abs(x - y) for x, y in zip(a["losses"], z["losses"])) <= 1e-5
    assert max(abs(x - y) / y for x, y in zip(a["norms"], z["norms"])) <= 1e-5
