"""Measure the host-side mechanisms of DeepSpeed ZeRO-3 CPU offload on this machine, with real DeepSpeed.

    python -m experiments.studies.zero3_mechanisms [--out results/zero3_mechanisms] [--quick]

Two measurements, each the median of timed repeats after a warm-up, written with provenance:

- `cpu_adam.csv`: DeepSpeedCPUAdam (AdamW mode, FP32 states) steps over one flat parameter of n
  elements: parameters per second, next to torch's fused AdamW on the same tensors (what megatrain
  runs). This is the optimizer throughput the planner charges ZeRO-3 (`cpu_adam_params_per_s`).
- `hooks.csv`: a stack of K bias-free `nn.Linear(d, d)` leaf modules trained under ZeRO-3 with
  parameters and optimizer offloaded to the CPU (the zero3 backend's documented tuning, sizes from
  d). DeepSpeed's own per-submodule entry points are wrapped with timers: the parameter
  coordinator's `fetch_sub_module` / `release_sub_module` (gather before a module runs, free after),
  the per-parameter gradient hook `reduce_independent_p_g_buckets_and_remove_grads` (bucket
  fill and flush), `partition_grads` (device->host copy and FP32 cast of a bucket) and the optimizer
  step. Per-call costs over K and d show what is a fixed Python cost per module and what scales with
  bytes. The same stack under plain PyTorch gives the compute the hooks add to.

DeepSpeed initializes torch.distributed once per process: each configuration runs in its own
subprocess (`--one`), as the zero3 backend's tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# (modules K, hidden d, reduce bucket): None is the documented tuning (d*d: every parameter fills a
# bucket, so each gradient hook flushes); DeepSpeed's default 5e8 flushes once, at the end of backward,
# which separates the per-parameter hook from the flush.
HOOK_SHAPES = [(8, 128, None), (32, 128, None), (128, 128, None), (8, 512, None), (32, 512, None),
               (8, 1024, None), (32, 1024, None), (32, 128, 500_000_000), (32, 512, 500_000_000),
               (32, 1024, 500_000_000)]
QUICK_HOOK_SHAPES = [(4, 64, None), (16, 64, 500_000_000)]
# HF Llama decoders of L layers at a small hidden size (bytes negligible): the per-layer slope of the
# time ZeRO-3 adds over the same model in plain PyTorch is the hooks' cost per decoder layer, with
# HF's module structure and its nested inputs/outputs (what the Linear stacks above cannot show).
HF_LAYERS = [2, 8, 24]
QUICK_HF_LAYERS = [1, 2]
HF_HIDDEN = 64
ADAM_SIZES = [1 << 20, 1 << 22, 1 << 24]
QUICK_ADAM_SIZES = [1 << 16]
WRAPPED = (
    ("coordinator", "fetch_sub_module"),
    ("coordinator", "release_sub_module"),
    ("stage3", "reduce_independent_p_g_buckets_and_remove_grads"),
    ("stage3", "partition_grads"),
    ("stage3", "_optimizer_step"),
)


def _timers() -> dict[str, list[float]]:
    """Wrap DeepSpeed's per-submodule entry points; returns name -> per-call seconds (appended live)."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero import stage3

    owners = {"coordinator": ppc.PartitionedParameterCoordinator, "stage3": stage3.DeepSpeedZeroOptimizer_Stage3}
    calls: dict[str, list[float]] = {}
    for owner, name in WRAPPED:
        cls = owners[owner]
        orig = getattr(cls, name)
        bucket = calls.setdefault(name, [])

        def timed(*a: Any, __orig=orig, __bucket=bucket, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return __orig(*a, **k)
            finally:
                __bucket.append(time.perf_counter() - t0)

        setattr(cls, name, timed)
    return calls


def _stack(k: int, d: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(k)])


def _plain_seconds(k: int, d: int, tokens: int, steps: int) -> float:
    import torch

    model = _stack(k, d)
    x = torch.randn(tokens, d)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_hooks(k: int, d: int, tokens: int, steps: int, reduce_bucket: int | None = None) -> dict[str, Any]:
    """One configuration, in this process: fwd+bwd(+step) under ZeRO-3 offload with per-call timers."""
    import deepspeed
    import torch

    from baselines.zero3 import build_ds_config, prepare_environment

    prepare_environment()
    calls = _timers()
    deepspeed.init_distributed(dist_backend="gloo")
    model = _stack(k, d)
    user = {"zero_optimization": {"reduce_bucket_size": reduce_bucket}} if reduce_bucket else None
    cfg = build_ds_config(user, gradient_accumulation_steps=1, mixed_precision="no", micro_batch_size=1,
                          hidden_size=d)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    cfg["gradient_clipping"] = 0.0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(tokens, d)
    # step 0 has no trace (DeepSpeed records the module order in it and prefetches from step 1 on)
    per_step: list[dict[str, float]] = []
    for i in range(steps + 2):
        for v in calls.values():
            v.clear()
        t0 = time.perf_counter()
        loss = engine(x).pow(2).mean()
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        if i >= 2:
            rec = {"fwd_s": t1 - t0, "bwd_s": t2 - t1, "step_s": t3 - t2}
            for name, v in calls.items():
                rec[f"{name}_n"] = len(v)
                rec[f"{name}_s"] = sum(v)
            per_step.append(rec)
    row = {key: statistics.median(r[key] for r in per_step) for key in per_step[0]}
    row["plain_fwd_bwd_s"] = _plain_seconds(k, d, tokens, steps)
    row["optimizer"] = type(engine.optimizer.optimizer).__name__
    zero = cfg["zero_optimization"]
    row.update({"modules": k, "hidden": d, "module_params": d * d, "tokens": tokens, "steps": steps,
                "prefetch_bucket": zero["stage3_prefetch_bucket_size"],
                "persistence_threshold": zero["stage3_param_persistence_threshold"],
                "reduce_bucket": zero["reduce_bucket_size"], "threads": torch.get_num_threads()})
    return row


def _hf_llama(layers: int, hidden: int) -> Any:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=int(2.75 * hidden), num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable()  # as the harness runs the baselines
    model.train()
    return model


def _hf_step_times(run: Any, steps: int) -> dict[str, float]:
    per: list[tuple[float, float]] = []
    for i in range(steps + 2):
        f, b = run()
        if i >= 2:
            per.append((f, b))
    return {"fwd_s": statistics.median(p[0] for p in per), "bwd_s": statistics.median(p[1] for p in per)}


def measure_hf(layers: int, hidden: int, tokens: int, steps: int) -> dict[str, Any]:
    """An HF Llama under ZeRO-3 offload vs the same model in plain PyTorch, forward and backward."""
    import deepspeed
    import torch

    from baselines.zero3 import build_ds_config, prepare_environment

    x = torch.randint(0, 256, (1, tokens))
    plain = _hf_llama(layers, hidden)

    def run_plain() -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = plain(input_ids=x, labels=x).loss
        t1 = time.perf_counter()
        loss.backward()
        plain.zero_grad(set_to_none=True)
        return t1 - t0, time.perf_counter() - t1

    base = _hf_step_times(run_plain, steps)
    prepare_environment()
    deepspeed.init_distributed(dist_backend="gloo")
    model = _hf_llama(layers, hidden)
    modules = sum(1 for _ in model.modules())
    cfg = build_ds_config(None, gradient_accumulation_steps=1, mixed_precision="no", micro_batch_size=1,
                          hidden_size=hidden)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    cfg["gradient_clipping"] = 0.0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def run_z3() -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        return t1 - t0, t2 - t1

    z3 = _hf_step_times(run_z3, steps)
    return {"layers": layers, "hidden": hidden, "tokens": tokens, "steps": steps, "modules": modules,
            "params": sum(p.ds_numel for p in model.parameters()), "zero3_fwd_s": z3["fwd_s"],
            "zero3_bwd_s": z3["bwd_s"], "plain_fwd_s": base["fwd_s"], "plain_bwd_s": base["bwd_s"],
            "threads": torch.get_num_threads()}


def measure_cpu_adam(n: int, reps: int) -> dict[str, Any]:
    """DeepSpeedCPUAdam and torch's fused AdamW over one flat parameter of n elements."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from baselines.zero3 import prepare_environment

    prepare_environment()
    out: dict[str, Any] = {"params": n, "threads": torch.get_num_threads()}
    for name, make in (("deepspeed_cpu_adam", lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, adamw_mode=True)),
                       ("torch_fused_adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = make([p])
        opt.step()  # allocates the state
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        out[f"{name}_s"] = s
        out[f"{name}_params_per_s"] = n / s
    return out


def _one(args: argparse.Namespace) -> int:
    spec = json.loads(args.one)
    if spec["kind"] == "hf":
        row = measure_hf(spec["layers"], spec["hidden"], spec["tokens"], spec["steps"])
    elif spec["kind"] == "hooks":
        row = measure_hooks(spec["k"], spec["d"], spec["tokens"], spec["steps"], spec.get("reduce_bucket"))
    else:
        row = measure_cpu_adam(spec["n"], spec["reps"])
    Path(args.result).write_text(json.dumps(row))
    return 0


def _run_child(spec: dict[str, Any], threads: int, timeout: float) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "r.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "experiments.studies.zero3_mechanisms", "--one", json.dumps(spec), "--result", str(res),
               "--threads", str(threads)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not res.exists():
            raise RuntimeError(f"{spec}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return json.loads(res.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "results" / "zero3_mechanisms"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a test of the script itself)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", choices=("adam", "hooks", "hf"), action="append",
                    help="measure only these (default: all); earlier CSVs of the others are kept")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        return _one(args)

    import pandas as pd

    from megatrain.metrics.provenance import cpu_model, git_commit, package_versions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit, dirty = git_commit()
    prov = {"git_commit": commit, "git_dirty": dirty, "versions": package_versions(), "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    only = set(args.only or ("adam", "hooks", "hf"))
    sizes = QUICK_ADAM_SIZES if args.quick else ADAM_SIZES
    adam = [_run_child({"kind": "adam", "n": n, "reps": 3 if args.quick else 7}, args.threads, 600)
            for n in sizes] if "adam" in only else []
    shapes = QUICK_HOOK_SHAPES if args.quick else HOOK_SHAPES
    steps = 2 if args.quick else args.steps
    hooks = [] if "hooks" not in only else [_run_child({"kind": "hooks", "k": k, "d": d, "tokens": args.tokens, "steps": steps, "reduce_bucket": rb},
                        args.threads, 900) for k, d, rb in shapes]
    hf = [] if "hf" not in only else [_run_child({"kind": "hf", "layers": n, "hidden": HF_HIDDEN, "tokens": args.tokens, "steps": steps},
                     args.threads, 900) for n in (QUICK_HF_LAYERS if args.quick else HF_LAYERS)]
    for rows, name in ((adam, "cpu_adam.csv"), (hooks, "hooks.csv"), (hf, "hf_layers.csv")):
        if not rows:
            continue
        df = pd.DataFrame(rows)
        for key, v in prov.items():
            df[key] = v
        df.to_csv(out / name, index=False)
        print(df.drop(columns=list(prov)).to_string(index=False))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
