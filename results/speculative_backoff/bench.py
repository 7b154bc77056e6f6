"""Clip on every step: speculative_step "auto" (settled as on CUDA) vs False vs True, paired on the CPU.

Three engines over the same model and batches, stepped in turn (the order rotated each step) so the machine's drift
hits all three alike; each step timed with its updates done (synchronize). A clip of 0.01 scales every step, so every
speculation is rolled back: "auto" backs off after 3 (speculative.py BACK_OFF_AFTER), True pays the rollback each
step. Prints JSON: median step seconds and the median of the per-step ratios to False, from step 4 on.
Run: PYTHONPATH=. python results/speculative_backoff/bench.py [steps]
"""

from __future__ import annotations

import copy
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import time

sys.path[:0] = ["tests", "tests/unit"]
import torch  # noqa: E402
from conftest import make_batches, tiny_model  # noqa: E402
from kit import train_steps  # noqa: E402

from megatrain.config.schema import IF_FITS, EngineConfig  # noqa: E402
from megatrain.engine import Engine  # noqa: E402
from megatrain.engine.update import speculative  # noqa: E402


def main(steps: int) -> dict:
    base = tiny_model("llama", layers=6, hidden=256, vocab=512)
    # overlap on for all three, as "auto" settles it on CUDA (where speculative_step "auto" is on)
    cfg = {"compute_dtype": "float32", "link_gbps": 50.0, "optimizer_overlap": True}
    engines = {"False": Engine(copy.deepcopy(base), EngineConfig(**cfg, speculative_step=False)),
               "True": Engine(copy.deepcopy(base), EngineConfig(**cfg, speculative_step=True))}
    resolve = speculative.resolve
    speculative.resolve = lambda config, *a, **k: resolve(dataclasses.replace(config, speculative_step=IF_FITS), *a, **k)
    engines["auto"] = Engine(copy.deepcopy(base), EngineConfig(**cfg))
    speculative.resolve = resolve
    batches = make_batches(steps, batch=2, seq=128, vocab=512)
    times: dict[str, list[float]] = {k: [] for k in engines}
    losses: dict[str, list] = {k: [] for k in engines}
    names = list(engines)
    for s in range(steps):
        order = names[s % 3:] + names[: s % 3]
        for k in order:
            t = time.perf_counter()
            out = train_steps(engines[k], batches, 1, clip=0.01, start=s)
            engines[k].synchronize()
            times[k].append(time.perf_counter() - t)
            losses[k].append(out)
    assert losses["auto"] == losses["False"] == losses["True"], "not bit-identical"
    warm = 3
    ratio = {k: statistics.median(a / b for a, b in zip(times[k][warm:], times["False"][warm:])) for k in ("auto", "True")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "megatrain"], capture_output=True, text=True).stdout)
    return {"steps": steps, "median_step_s": {k: statistics.median(v[warm:]) for k, v in times.items()},
            "median_paired_ratio_to_False": ratio,
            "stats": {k: {x: e.collect_stats()[x] for x in ("speculative_rollbacks", "speculative_backoffs",
                                                            "speculative_layers")} for k, e in engines.items()},
            "bit_identical_losses": True,
            "provenance": {"commit": commit, "dirty": dirty, "machine": platform.processor() or platform.machine(),
                           "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].split(":", 1)[1].strip(),
                           "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 40), indent=1))
