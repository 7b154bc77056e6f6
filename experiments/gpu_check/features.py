"""Phase features: what only a GPU run decides, each against the engine's own serial or streamed run, bit for bit.

- speculation: the host update speculated in backward (`speculative_step`) against the serial step, with a clip
  that scales every step (each speculated layer rolled back and redone) and one that never does (none rolled
  back): losses and final weights bit-identical, rollbacks counted;
- a NaN loss with `skip_nonfinite`: the step is skipped (weights untouched) and the run goes on as if that batch
  had never come, bit for bit;
- device-tensor batches (as HF Trainer and Accelerate hand them) through forward, the loss and backward under
  `torch.cuda.set_sync_debug_mode("error")`: any synchronizing call raises (CUDA only);
- residency "stream" against "auto" (on a large device every layer kept, updated on the device): losses and
  weights bit-identical.
"""

from __future__ import annotations

import copy
from typing import Any

from .common import Ctx, Shapes, make_batches, tiny_model

SHAPES = {False: Shapes(64, 3, 256, 32, 2), True: Shapes(256, 4, 1024, 128, 2)}
STEPS = 4
CLIP_SCALES = 1e-4  # far under any gradient norm here: every step clipped
CLIP_IDLE = 1e6  # far over: never clipped


def _train(eng: Any, batches: list[dict], clip: float | None = None, nan_at: int | None = None
           ) -> tuple[list[float], list[bool]]:
    losses, stepped = [], []
    for i, b in enumerate(batches):
        loss = eng(**b).loss
        eng.backward(loss * float("nan") if i == nan_at else loss)
        losses.append(float(loss.detach()))
        if clip:
            eng.clip_grad_norm_(clip)
        stepped.append(bool(eng.step()))
        eng.zero_grad()
    eng.synchronize()
    return losses, stepped


def _weights(eng: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in eng.state_dict().items()}


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    return [k for k in a if not torch.equal(a[k], b[k])]


def phase_features(ctx: Ctx) -> None:
    import torch

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    sh = SHAPES[ctx.cuda]
    base = tiny_model("llama", sh)
    batches = make_batches(STEPS, sh)
    dev = str(ctx.device)

    def engine(**knobs: Any) -> Any:
        return Engine(copy.deepcopy(base), EngineConfig(device=dev, parity_probe=False, **knobs))

    def speculation(clip: float) -> dict[str, Any]:
        # every layer streamed, so every layer is host-updated and may be speculated
        off = engine(residency="stream", speculative_step=False)
        on = engine(residency="stream", speculative_step=True)
        off_losses, _ = _train(off, batches, clip)
        on.reset_stats()
        on_losses, _ = _train(on, batches, clip)
        st = on.collect_stats()
        diff = _differing(_weights(off), _weights(on))
        layers, rollbacks = st.get("speculative_layers", 0), st.get("speculative_rollbacks", 0)
        clipped = clip == CLIP_SCALES
        # a clip that scales rolls every speculated layer back each step; one that never scales rolls none back
        rolled_as_expected = rollbacks > 0 if clipped else rollbacks == 0
        return {"ok": off_losses == on_losses and not diff and layers > 0 and rolled_as_expected,
                "losses_identical": off_losses == on_losses, "weights_differing": diff[:5],
                "speculative_layers": layers, "speculative_rollbacks": rollbacks, "clip": clip, "steps": STEPS}

    ctx.check("speculation_clip_scales", lambda: speculation(CLIP_SCALES))
    ctx.check("speculation_clip_idle", lambda: speculation(CLIP_IDLE))

    def nan_skipped() -> dict[str, Any]:
        bad = engine(residency="stream", skip_nonfinite=True)
        losses, stepped = _train(bad, batches, 1.0, nan_at=1)
        clean = engine(residency="stream", skip_nonfinite=True)
        clean_losses, _ = _train(clean, batches[:1] + batches[2:], 1.0)
        diff = _differing(_weights(bad), _weights(clean))
        same = losses[:1] + losses[2:] == clean_losses
        return {"ok": stepped == [True, False] + [True] * (STEPS - 2) and same and not diff, "stepped": stepped,
                "losses_as_if_skipped_batch_never_came": same, "weights_differing": diff[:5]}

    ctx.check("nan_loss_skipped", nan_skipped)

    def device_batches() -> dict[str, Any]:
        if not ctx.cuda:
            return {"ok": True, "status": "skipped", "reason": "torch.cuda.set_sync_debug_mode exists on CUDA only"}
        eng = engine(residency="stream")
        on_dev = [{k: v.to(ctx.device) for k, v in b.items()} for b in batches]
        _train(eng, on_dev[:1])  # warm-up: first-touch allocations are not the steady state
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = eng(**on_dev[1]).loss
            eng.backward(loss)
        except RuntimeError as exc:
            return {"ok": False, "error": f"a synchronizing call in forward, loss or backward: {exc}"[:600]}
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        eng.step()
        eng.zero_grad()
        return {"ok": True, "loss": float(loss.detach())}

    ctx.check("device_batches_no_sync", device_batches)

    def stream_vs_auto() -> dict[str, Any]:
        runs = {}
        for residency in ("stream", "auto"):
            eng = engine(residency=residency)
            eng.reset_stats()
            losses, _ = _train(eng, batches, 1.0)
            st = eng.collect_stats()
            runs[residency] = (losses, _weights(eng), st.get("resident_weight_layers"))
        diff = _differing(runs["stream"][1], runs["auto"][1])
        same = runs["stream"][0] == runs["auto"][0]
        return {"ok": same and not diff, "losses_identical": same, "weights_differing": diff[:5],
                "loss_abs": max(abs(a - b) for a, b in zip(runs["stream"][0], runs["auto"][0])),
                "auto_resident_weight_layers": runs["auto"][2], "stream_resident_weight_layers": runs["stream"][2]}

    ctx.check("residency_stream_vs_auto_identical", stream_vs_auto)
