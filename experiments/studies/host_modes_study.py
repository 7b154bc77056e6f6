"""What each host-memory mode costs in accuracy: loss curves vs the FP32-master reference (an experiment,
not a test; its results are committed under results/host_modes/).

    python -m experiments.studies.host_modes_study [--preset llama-100m] [--steps 300] [--lr 1e-4]

Every mode trains the same model from the same initial weights on the same batches (a synthetic corpus
with learnable structure: 256 of the ids, each with 2 likely successors), bf16 compute, AdamW at a constant LR,
one micro-batch per step and no clipping (so the optimizer-in-backward mode runs too). Writes
loss_curves.csv (mode, step, loss), study.md (a table) and loss_curves.png (the figure), after each mode.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import time
from pathlib import Path

import torch

MODES = [
    ("fp32 master (reference)", {}),
    ("bf16 master, nearest rounding (paper's code)", {"host_master": "bf16", "host_grad_dtype": "bfloat16"}),
    ("bf16 master, stochastic rounding", {"host_master": "bf16", "host_grad_dtype": "bfloat16",
                                          "bf16_rounding": "stochastic"}),
    ("hilo + optimizer in backward (exact)", {"host_master": "hilo", "optimizer_in_backward": True}),
]


def corpus(vocab: int, n_seq: int, seq: int, seed: int = 0, used: int = 256) -> torch.Tensor:
    """Token sequences from a fixed random Markov chain over `used` of the vocabulary's ids: 90% of the mass
    on 2 successors per token. Learnable in a few hundred small steps: first which ids occur (the loss
    falls from ln(vocab) towards ln(used)), then the successors."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:used]
    succ = torch.randint(0, used, (used, 2), generator=g)
    out = torch.empty(n_seq, seq + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, used, (n_seq,), generator=g)
    for t in range(seq):
        likely = torch.rand(n_seq, generator=g) < 0.9
        pick = succ[out[:, t], torch.randint(0, 2, (n_seq,), generator=g)]
        out[:, t + 1] = torch.where(likely, pick, torch.randint(0, used, (n_seq,), generator=g))
    return ids[out]


def run_mode(model, cfg: dict, data: torch.Tensor, batch: int, steps: int, lr: float) -> list[float]:
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    eng = Engine(copy.deepcopy(model), EngineConfig(device="cpu", compute_dtype="bfloat16", parity_probe=False, **cfg),
                 optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=0.0, fused=True))
    losses = []
    t0 = time.perf_counter()
    for s in range(steps):
        rows = data[(s * batch) % len(data):][:batch]
        loss = eng(input_ids=rows[:, :-1], labels=rows[:, :-1].clone()).loss
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
        if (s + 1) % 25 == 0:
            print(f"  step {s + 1}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return losses


def write(out: Path, curves: dict[str, list[float]], meta: dict) -> None:
    with open(out / "loss_curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "step", "loss"])
        for mode, ls in curves.items():
            w.writerows([mode, i + 1, f"{v:.6f}"] for i, v in enumerate(ls))
    ref = curves.get(MODES[0][0])
    lines = [f"Loss of each host-memory mode vs the FP32-master reference: {meta['preset']} "
             f"({meta['params'] / 1e6:.0f}M params), {meta['steps']} steps, micro-batch {meta['batch']} x "
             f"{meta['seq']} tokens, bf16 compute, AdamW lr {meta['lr']:g}, CPU device", "",
             "| mode | exact | mean loss, last 50 steps | minus reference | max abs diff to reference, any step | "
             "steps bit-identical to reference |", "|---|---|---|---|---|---|"]
    for mode, ls in curves.items():
        tail = sum(ls[-50:]) / len(ls[-50:])
        if ref is not None:
            n = min(len(ls), len(ref))
            rt = sum(ref[-50:]) / len(ref[-50:])
            diff = max(abs(a - b) for a, b in zip(ls[:n], ref[:n]))
            same = sum(a == b for a, b in zip(ls[:n], ref[:n]))
            extra = f"{tail - rt:+.4f} | {diff:.4f} | {same} of {n}"
        else:
            extra = "- | - | -"
        exact = "no" if "bf16 master" in mode else "yes"
        lines.append(f"| {mode} | {exact} | {tail:.4f} | {extra} |")
    lines += ["", f"provenance: {json.dumps(meta['provenance'])}"]
    (out / "study.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for mode, ls in curves.items():
            axes[0].plot(range(1, len(ls) + 1), ls, label=mode, linewidth=1)
            if ref is not None:
                axes[1].plot(range(1, len(ls) + 1), [a - b for a, b in zip(ls, ref)], label=mode, linewidth=1)
        axes[0].set(xlabel="step", ylabel="loss", title=f"{meta['preset']}, measured (CPU)")
        axes[1].set(xlabel="step", ylabel="loss - reference loss", title="difference to the FP32-master reference")
        for ax in axes:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "loss_curves.png", dpi=110)
    except ImportError:
        pass


def merge(dirs: list[Path], out: Path, a: argparse.Namespace) -> None:
    """One table and figure from runs made in parallel processes (same settings, one mode each)."""
    curves: dict[str, list[float]] = {}
    for d in dirs:
        with open(d / "loss_curves.csv") as f:
            for row in csv.DictReader(f):
                curves.setdefault(row["mode"], []).append(float(row["loss"]))
    order = [m for m, _ in MODES if m in curves]
    meta = json.loads((dirs[0] / "meta.json").read_text())
    write(out, {m: curves[m] for m in order}, meta)


def main() -> None:
    import transformers

    from megatrain.metrics.provenance import provenance
    from megatrain.models.presets import get_preset

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-100m")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="results/host_modes")
    ap.add_argument("--modes", type=int, default=len(MODES), help="run the first N modes only")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N modes (to run modes in parallel processes)")
    ap.add_argument("--merge", nargs="+", help="combine the loss_curves.csv of these folders into --out, then stop")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.merge:
        merge([Path(d) for d in a.merge], out, a)
        return
    p = get_preset(a.preset)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(p.hf_config())
    data = corpus(p.vocab, 512, a.seq)
    meta = {"preset": a.preset, "params": sum(t.numel() for t in model.parameters()), "steps": a.steps,
            "batch": a.batch, "seq": a.seq, "lr": a.lr, "provenance": {**provenance(), "threads": torch.get_num_threads()}}
    curves: dict[str, list[float]] = {}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    for mode, cfg in MODES[a.skip: a.modes]:
        t0 = time.perf_counter()
        curves[mode] = run_mode(model, cfg, data, a.batch, a.steps, a.lr)
        print(f"{mode}: final {curves[mode][-1]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        write(out, curves, meta)


if __name__ == "__main__":
    main()
