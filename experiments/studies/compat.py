"""Probe every causal LM the installed transformers ships and write the measured compatibility table.

    python -m experiments.studies.compat                      # docs/COMPATIBILITY.md + results/compat/compat.csv
    python -m experiments.studies.compat --only llama gemma   # a few types, printed

Each model type is built from a valid config (its default, with what the default leaves unusable filled from the
family's config class: compat_configs.py, the `filled` column) shrunk by the parity probe
(megatrain/engine/model/probe.py) and trained three steps with plain PyTorch and with MegaTrain on the CPU: exact / mismatch / refused (reason) /
crashed (the tiny model or the run failed), twice: FP32 compute, and bf16 compute against plain PyTorch's bf16
scheme (FP32 masters). Where the bf16 verdict is exact, the engine with hi/lo masters is also run against the
engine with FP32 masters (AdamW, bf16 compute): the losses must be bit for bit the same. A scalar logit setting
left at 1 by the default config (logit_scale, logits_scaling, output_multiplier_scale) is set to a non-default
value first, so the head's scale is measured. Nothing here is written by hand.
"""

from __future__ import annotations

import argparse
import csv
import platform
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from experiments.studies.compat_configs import study_config
from megatrain.engine import Engine, check_config
from megatrain.engine.parts import Verdict, probe
from megatrain.models.lookup import causal_lm_types

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ["model_type", "architecture", "status", "max_grad_rel", "max_loss_diff", "detail", "bf16_status",
          "bf16_grad_rel", "bf16_loss_diff", "bf16_detail", "hilo", "overrides", "filled"]
TIMEOUT_S = 300  # per verdict; the bf16 one runs four trainings (FP32 and bf16 references, two engines)
# Types whose probe needs longer, measured on this 2-core machine under load (the slow part named).
TIME_LIMITS_S = {
    "falcon_h1": 600,  # its Mamba mixer's torch path: the bf16 probe ran past 150 s on a loaded machine
}
# Non-default values for scalar logit settings whose default is 1 (the head's scale would go unmeasured).
NON_DEFAULT = {"logit_scale": 0.5, "logits_scaling": 2.0, "output_multiplier_scale": 2.0}
# The probe's parts, innermost first, by the function running when the time limit fired.
_PARTS = {"_build": "building the small model", "train_plain": "plain PyTorch's training",
          "bf16_floor": "plain PyTorch's bf16 floor", "_train_engine": "the engine's training",
          "hilo_identical": "the hi/lo check"}


class _Timeout(BaseException):  # not an Exception: the probe's own handlers must not take it for a crash
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise _Timeout(_running_part(frame))


def _running_part(frame) -> str:
    """The probe's part the interrupted frame stack is in, with its dtype: "the engine's training (bfloat16)"."""
    while frame is not None:
        part = _PARTS.get(frame.f_code.co_name)
        if part is not None:
            loc = frame.f_locals
            dtype = loc.get("dtype") or getattr(loc.get("mode"), "compute_dtype", None)
            return part + (f" ({str(dtype).replace('torch.', '')})" if dtype is not None else "")
        frame = frame.f_back
    return "the probe"


def time_limit(model_type: str, scale: float = 1.0) -> int:
    return int(TIME_LIMITS_S.get(model_type, TIMEOUT_S) * scale)


def _overrides(model_type: str) -> dict:
    try:
        config = study_config(model_type)[1]
    except Exception:  # noqa: BLE001 - the probe reports it
        return {}
    return {k: v for k, v in NON_DEFAULT.items() if getattr(config, k, None) in (1, 1.0)}


def _filled(model_type: str) -> str:
    """What study_config filled, short: a per-layer list as its length and kinds."""
    try:
        filled = study_config(model_type)[2]
    except Exception as exc:  # noqa: BLE001 - the probe reports it
        return f"({type(exc).__name__})"
    out = []
    for k, v in filled.items():
        if isinstance(v, list) and len(v) > 4:
            v = f"[{len(v)} x {'/'.join(dict.fromkeys(map(str, v)))}]"
        out.append(f"{k}={v}")
    return " ".join(out)


def check(model_type: str, compute_dtype: str = "float32", overrides: dict | None = None) -> Verdict:
    """The probe's verdict for `model_type` built from its study config (compat_configs.study_config)."""
    model_cls, config, _ = study_config(model_type)
    return check_config(model_cls, config, compute_dtype, overrides=overrides)


def _verdict(call, limit: int) -> Verdict:
    """`call()`'s verdict within `limit` seconds: past it, a "timeout" naming the part that was running (a slow
    machine is not a crash); any exception a "crashed" row."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return call()
    except _Timeout as t:
        return Verdict("timeout", f"the probe ran past its {limit} s limit in {t}", "?")
    except Exception as exc:  # noqa: BLE001 - every type gets a row, whatever goes wrong
        return Verdict("crashed", f"{type(exc).__name__}: {exc}", "?")
    finally:
        signal.alarm(0)


def hilo_identical(model_type: str, overrides: dict) -> str:
    """'identical' when the engine with hi/lo masters trains the probe's small model with bit for bit the losses
    and first-step gradients of the engine with FP32 masters (bf16 compute, AdamW, 3 steps); else what differs."""
    model_cls, config, _ = study_config(model_type)
    for k, v in overrides.items():
        setattr(config, k, v)
    tiny = probe.tiny_config(config)
    master = probe._build(model_cls, tiny, config)
    master.float().train()
    batches = probe._batches(probe.STEPS, vars(tiny).get("vocab_size") or probe._VOCAB, probe._SEQ)
    runs = []
    make_opt = probe._optimizer(probe._Mode("bfloat16", "hilo"), True)  # AdamW for both: hi/lo takes nothing else
    with torch.random.fork_rng(devices=[]):
        for host_master in ("fp32", "hilo"):
            runs.append(probe._train_engine(master, batches, Engine, probe._Mode("bfloat16", host_master), make_opt,
                                            "?"))
    (a, _), (b, _) = runs
    if a == b:
        return "identical"
    return f"differs: loss {max(abs(x - y) for x, y in zip(a, b)):.1e} (first at step {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)})"


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.1e}"


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text[:300] + ("..." if len(text) > 300 else "")


def probe_type(model_type: str, bf16: bool = True, scale: float = 1.0) -> dict:
    """The table's row for `model_type`: FP32, then bf16 and hi/lo where FP32 is exact; each verdict within the
    type's time limit times `scale`."""
    overrides = _overrides(model_type)
    limit = time_limit(model_type, scale)
    v = _verdict(lambda: check(model_type, overrides=overrides), limit)
    row = {"model_type": model_type, "architecture": v.architecture, "status": v.status,
           "max_grad_rel": _fmt(v.max_grad_rel), "max_loss_diff": _fmt(v.max_loss_diff), "detail": _short(v.detail),
           "bf16_status": "", "bf16_grad_rel": "", "bf16_loss_diff": "", "bf16_detail": "", "hilo": "",
           "overrides": " ".join(f"{k}={v}" for k, v in overrides.items()), "filled": _filled(model_type)}
    if not bf16:
        return row
    if v.status != "exact":
        row["bf16_status"] = "-"
        row["bf16_detail"] = f"not exact in FP32 ({v.status})"
        return row
    b = _verdict(lambda: check(model_type, "bfloat16", overrides=overrides), limit)
    row.update(bf16_status=b.status, bf16_grad_rel=_fmt(b.max_grad_rel), bf16_loss_diff=_fmt(b.max_loss_diff),
               bf16_detail=_short(b.detail))
    if b.status == "exact":
        h = _verdict(lambda: Verdict("exact", hilo_identical(model_type, overrides), "?"), limit)
        row["hilo"] = h.detail if h.status == "exact" else _short(h.detail)
    return row


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(rows: list[dict], md: Path, out_csv: Path) -> None:
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with out_csv.open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    statuses = ("exact", "mismatch", "refused", "crashed", "timeout")
    counts = {s: sum(r["status"] == s for r in rows) for s in statuses}
    counts16 = {s: sum(r["bf16_status"] == s for r in rows) for s in statuses}
    hilo = sum(r["hilo"] == "identical" for r in rows)
    lines = [
        "# Which architectures MegaTrain trains exactly",
        "",
        "Measured, not written: `python -m experiments.studies.compat` builds every causal-LM model type of the "
        "installed transformers from a valid config (its default, with what the default leaves unusable filled "
        "from the family's own config class: the causal LM's own sub-config, sizes left None, rope tables, "
        "per-layer lists sized to the layer count; the filled column, experiments/studies/compat_configs.py), "
        "shrunk by the parity probe (2 layers, hidden 64, "
        "vocabulary 256; every structural option kept), and trains it 3 steps with plain PyTorch and with "
        "MegaTrain on the CPU, in both compute dtypes a user gets (FP32 on a CPU device, bf16 on a GPU: "
        "`compute_dtype: auto`). The engine runs the same probe on first use of an architecture, in its own "
        "compute dtype and host mode, and refuses what is not exact; `megatrain check-model TYPE_OR_PATH` runs it "
        "on demand.",
        "",
        "- **FP32** (SGD): first-step gradients within 1e-5 of the tensor's largest entry (floored at 1e-2 of the "
        "model's largest gradient) and per-step losses within 1e-5 of plain PyTorch's.",
        "- **bf16**: the engine with `compute_dtype=\"bfloat16\"` against plain PyTorch's same mixed-precision "
        "scheme: FP32 masters, a compute copy with every parameter in bf16 (buffers as the model holds them, as the "
        "engine places them), the engine's two casts (the first layer's input to bf16, the head's input to the "
        "head's dtype), gradients cast to FP32 onto the masters, the step on the masters, the masters rounded into "
        "the copy. Tolerance: 4x the reference's own bf16 floor, measured per model on every probe as the distance "
        "between that bf16 reference and the FP32 reference of the same scheme (same masters, batches and steps), "
        "floored at one bf16 ulp (2^-8); the same metrics as FP32. Two independent bf16 roundings of one "
        "computation differ by up to about twice the floor of either; real defects (a dropped scale, a wrong cast) "
        "move gradients by 1e-1 and more. Eager against SDPA attention in bf16 was measured as the floor too and "
        "rejected: 0.72 on Llama and 1.0 on Qwen3-MoE (one near-zero gradient each), so 4x it passes anything, "
        "and it is zero for models without attention. The bf16 check runs after the FP32 one, which still catches "
        "what bf16 rounding would hide (a soft-cap, a small scale).",
        "- **hilo**: where bf16 is exact, the engine with hi/lo masters (`host_master: hilo`) against the engine "
        "with FP32 masters, AdamW, bf16 compute: `identical` means bit for bit the same losses.",
        "- **refused**: MegaTrain declines it by name before training (the reason is given); **crashed**: plain "
        "PyTorch or the engine failed on the small model (the detail says which; in bf16, often a model whose own "
        "code mixes FP32 buffers with bf16 tensors); **timeout**: the probe ran past the type's time limit, in the "
        "part named (the study retries a timed-out type once, alone, with twice the limit).",
        "- A scalar logit setting the default config leaves at 1 is set to another value first (the overrides "
        "column), so the head's scale is measured: " + ", ".join(f"`{k}` {v}" for k, v in NON_DEFAULT.items())
        + ".",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, commit {_commit()}. FP32: "
        + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(rows)} model types. bf16 (of the "
        f"{counts['exact']} exact in FP32): " + ", ".join(f"{n} {s}" for s, n in counts16.items())
        + f". hi/lo masters identical to FP32 masters in bf16: {hilo} of {counts16['exact']}.",
        "",
        "| model type | class | FP32 | grad err | loss diff | bf16 | grad err | loss diff | hilo | overrides | "
        "filled | detail |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        detail = " ".join(x for x in (r["detail"], r["bf16_detail"] and f"bf16: {r['bf16_detail']}",
                                      r["hilo"] not in ("", "identical") and f"hilo: {r['hilo']}") if x)
        detail = detail.replace("|", "\\|")
        lines.append(f"| {r['model_type']} | {r['architecture']} | {r['status']} | {r['max_grad_rel']} | "
                     f"{r['max_loss_diff']} | {r['bf16_status']} | {r['bf16_grad_rel']} | {r['bf16_loss_diff']} | "
                     f"{r['hilo']} | {r['overrides']} | {r.get('filled', '')} | {detail} |")
    md.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="probe these model types and print the rows; write nothing")
    ap.add_argument("--redo", nargs="*", help="probe these model types again and replace their rows in --csv; "
                    "rewrite the table from it")
    ap.add_argument("--md", default=str(ROOT / "docs" / "COMPATIBILITY.md"))
    ap.add_argument("--csv", default=str(ROOT / "results" / "compat" / "compat.csv"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.redo:
        with open(args.csv, newline="") as f:
            kept = {r["model_type"]: r for r in csv.DictReader(f)}
        for t in args.redo:
            kept[t] = probe_type(t)
            print(t, kept[t])
        write([kept[t] for t in sorted(kept)], Path(args.md), Path(args.csv))
        return 0
    types = args.only or causal_lm_types()
    rows = []
    for t in (bar := tqdm(types, unit="type", dynamic_ncols=True)):
        bar.set_postfix_str(t)
        rows.append(probe_type(t))
        r = rows[-1]
        tqdm.write(f"{t}: {r['status']} {r['max_grad_rel']} {r['max_loss_diff']} {r['detail'][:120]} | bf16 "
                   f"{r['bf16_status']} {r['bf16_grad_rel']} {r['bf16_loss_diff']} {r['bf16_detail'][:120]} | "
                   f"{r['hilo'][:60]}")
    for i, r in enumerate(rows):  # a type that ran out of time under load: once more, alone, with twice the limit
        if "timeout" in (r["status"], r["bf16_status"]):
            rows[i] = probe_type(r["model_type"], scale=2.0)
            tqdm.write(f"{r['model_type']} again: {rows[i]['status']} | bf16 {rows[i]['bf16_status']}")
    if not args.only:
        write(rows, Path(args.md), Path(args.csv))
        print(f"wrote {args.md} and {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
