"""The `megatrain` command: sweep, report, train, launch, and the planner's plan / bench.

    megatrain sweep experiments/sweeps/quick.yaml          # run (skips points already recorded)
    megatrain report results/quick                           # report.md + PNGs in results/quick
    megatrain report runs/mine --notebook                    # and the figures notebook run on that sweep
    megatrain train run.yaml                                 # one run with a progress bar
    megatrain check-model gemma                              # does MegaTrain train this architecture exactly?
    megatrain launch --nproc-per-node 2 train.py --lr 1e-4   # an unchanged script, DeepSpeed routed to MegaTrain
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path


def _cmd_sweep(args: argparse.Namespace) -> int:
    from experiments.cli import sweep

    return sweep(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from experiments.cli import report

    return report(args)


def _cmd_sft(args: argparse.Namespace) -> int:
    from .sft import check_run_model, load_run, prepare, train
    from .sft_resume import prepare_output

    def say(msg: str) -> None:
        print(f"megatrain train: {msg}", file=sys.stderr, flush=True)

    # Everything is checked (config, every data record, the model, the output folder) before anything is written.
    try:
        run = load_run(args.sft_config, args.set)
        prep = prepare(run)
        if run.backend == "megatrain":
            check_run_model(run)
        resume_from, note = prepare_output(run.output_dir, dataclasses.asdict(run), restart=args.restart)
    except ValueError as e:
        if args.debug:
            raise
        print(f"megatrain train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted before training began; nothing was written")
        return 130
    if note:
        say(note)
    written = _output_state(run.output_dir)
    try:
        out = train(prep, resume_from=resume_from)
    except _engine_refusals() as e:
        # a refusal only the engine, building its store, can see (the host memory): said in one paragraph, and
        # what this run wrote before it is undone, so the folder is as it was
        _restore_output(run.output_dir, written)
        if args.debug:
            raise
        print(f"megatrain train: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted without a checkpoint of this step (a second signal stops at once); the same command "
            f"resumes from the newest whole checkpoint in {run.output_dir}, if there is one")
        return 130
    losses = list(out["losses"].values())
    if out["stopped"] is not None:
        say(f"stopped on {out['stopped']} after step {out['global_step']}; checkpoint saved to {out['checkpoint']}. "
            "Run the same command again to resume (add --restart to start over)")
        return 128 + int(getattr(signal, out["stopped"]))
    print(f"{run.model} on {run.data} ({out['engine']}): {len(losses)} logged steps, loss "
          f"{losses[0]:.4f} -> {losses[-1]:.4f}; saved to {run.output_dir}/final")
    return 0


def _engine_refusals() -> tuple[type[BaseException], ...]:
    from ..engine import HostMemoryError, ModelMismatchError, PinnedMemoryError

    return HostMemoryError, PinnedMemoryError, ModelMismatchError


def _output_state(output_dir: str) -> bytes | None | bool:
    """What the run record held before this run (its bytes), None when the folder held none, False when there
    was no folder."""
    from .sft_resume import RUN_FILE

    out = Path(output_dir)
    if not out.exists():
        return False
    return (out / RUN_FILE).read_bytes() if (out / RUN_FILE).is_file() else None


def _restore_output(output_dir: str, before: bytes | None | bool) -> None:
    from .sft_resume import RUN_FILE

    out = Path(output_dir)
    if before is False:
        shutil.rmtree(out, ignore_errors=True)
    elif before is None:
        (out / RUN_FILE).unlink(missing_ok=True)
    else:
        (out / RUN_FILE).write_bytes(before)


def _cmd_train(args: argparse.Namespace) -> int:
    if (args.sft_config is None) == (args.config is None):
        print("megatrain train: error: give --config SFT.yaml (fine-tune your model on your data) or a benchmark "
              "point's YAML as the argument, not both", file=sys.stderr)
        return 2
    if args.sft_config is not None:
        if args.model or args.trace:
            print("megatrain train: error: --model and --trace belong to benchmark points; an SFT config names its "
                  "model itself (model: DIR)", file=sys.stderr)
            return 2
        return _cmd_sft(args)
    if args.restart:
        print("megatrain train: error: --restart belongs to --config runs (a benchmark point keeps no checkpoints)",
              file=sys.stderr)
        return 2
    from experiments.cli import run_point

    return run_point(args)


def _cmd_check_model(args: argparse.Namespace) -> int:
    from .check import check_model

    try:
        verdict = check_model(args.model)
    except ValueError as e:
        print(f"megatrain check-model: error: {e}", file=sys.stderr)
        return 2
    figures = ""
    if verdict.max_grad_rel is not None:
        figures = f" (first-step gradients within {verdict.max_grad_rel:.1e} relative"
        figures += f", losses within {verdict.max_loss_diff:.1e})" if verdict.max_loss_diff is not None else ")"
    print(f"{verdict.architecture}: {verdict.status}{figures}" + (f": {verdict.detail}" if verdict.detail else ""))
    print(f"transformers {verdict.transformers_version}")
    return 0 if verdict.exact else 1


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    ap = argparse.ArgumentParser(prog="megatrain", description="MegaTrain: sweeps, reports and single runs.")
    ap.add_argument("--version", action="version", version=f"megatrain {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    sp = sub.add_parser("sweep", help="run a sweep spec; one results row per point",
                        description="Run every point of a sweep spec, each in its own subprocess; rows go to "
                                    "results/<sweep>/results.csv (or --out DIR). Points already recorded are skipped.")
    sp.add_argument("spec", help="sweep spec YAML, e.g. experiments/sweeps/quick.yaml")
    sp.add_argument("--only", action="append", metavar="KEY=V[,V]",
                    help="run only matching points (repeatable; keys: backend, model, seq_len, micro_batch, ...)")
    sp.add_argument("--dry-run", action="store_true", help="list the points and the preflight verdicts; run nothing")
    sp.add_argument("--force", action="store_true", help="re-run points already recorded (their rows are replaced)")
    sp.add_argument("--retry-failed", action="store_true", help="re-run points recorded as failed or timeout")
    sp.add_argument("--out", default=None, help="results directory (default: results/<sweep name>)")
    sp.add_argument("--report", action="store_true", help="write the report when the sweep finishes")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    ex = sp.add_argument_group("where the points run")
    ex.add_argument("--executor", choices=("local", "ray", "slurm"), default="local",
                    help="local: one after another here (default); ray: Ray tasks on a cluster; "
                         "slurm: one Slurm job per point (submitit). Needs pip install 'megatrain[cluster]'")
    ex.add_argument("--address", default=None,
                    help="ray: the cluster to join: auto, ray://HOST[:PORT] or HOST:PORT "
                         "(default: start a local Ray cluster on this machine)")
    ex.add_argument("--cluster-cpus", type=int, default=None, metavar="N",
                    help="ray: CPUs of the local cluster started without --address (default: all)")
    ex.add_argument("--cpus-per-point", type=int, default=1, metavar="N",
                    help="ray / slurm: CPUs reserved for each point (default 1)")
    ex.add_argument("--gpus-per-point", type=int, default=0, metavar="N",
                    help="ray / slurm: GPUs reserved for each point (default 0; give 1 on a GPU cluster)")
    ex.add_argument("--partition", default=None, help="slurm: the partition to submit to")
    sp.set_defaults(func=_cmd_sweep)

    rp = sub.add_parser("report", help="markdown tables and PNG plots from a results directory")
    rp.add_argument("dir", help="results directory (holding results.csv) or the CSV itself")
    rp.add_argument("--out", default=None, help="where to write (default: the results directory)")
    rp.add_argument("--notebook", action="store_true",
                    help="also run notebooks/figures.ipynb on the results (nbclient and ipykernel, the dev extra); "
                         "the run notebook and its figures go to <out>/notebook/")
    rp.set_defaults(func=_cmd_report)

    tp = sub.add_parser("train", help="fine-tune a model on your data (--config), or run one benchmark point",
                        description="--config SFT.yaml: supervised fine-tuning of a local model directory on a local "
                                    "alpaca / sharegpt / messages JSON or JSONL file with TRL's SFTTrainer on MegaTrain "
                                    "(see examples/sft/sft.yaml). The config and every record are checked before "
                                    "anything is written; a checkpoint is written every save_minutes (30) and on "
                                    "Ctrl-C / SIGTERM, and the same command again resumes from the newest whole "
                                    "one (--restart starts over). A positional YAML instead: one benchmark "
                                    "point, the keys of a sweep point (backend, model, seq_len, micro_batch, "
                                    "grad_accum, precision, engine, steps, ...).")
    tp.add_argument("config", nargs="?", default=None, help="a benchmark point's YAML")
    tp.add_argument("--config", dest="sft_config", default=None, metavar="SFT.yaml",
                    help="an SFT run: model, data, output_dir, ... and a 'megatrain' section of engine settings")
    tp.add_argument("--model", default=None, help="the model: a preset name, or a local model directory / config.json "
                                                  "(its shape, with random weights); overrides the config's model")
    tp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key (YAML value), repeatable")
    tp.add_argument("--trace", default=None, help="write the engine trace of the last step here (megatrain)")
    tp.add_argument("--debug", action="store_true",
                    help="--config: a refused model or setting raises with its traceback instead of one paragraph")
    tp.add_argument("--restart", action="store_true",
                    help="--config: start over, deleting the checkpoints of an earlier run in output_dir (without "
                         "it the same command resumes from the newest whole checkpoint there)")
    tp.set_defaults(func=_cmd_train)

    cp = sub.add_parser("check-model", help="prove MegaTrain trains an architecture exactly (parity probe)",
                        description="Build a tiny model of the same class and structural options, train it with "
                                    "plain PyTorch and with MegaTrain, compare gradients and losses. Exit 0 when "
                                    "exact, 1 when refused/mismatched/crashed, 2 on bad input.")
    cp.add_argument("model", help="a model type (e.g. llama, gemma) or a local checkpoint directory / config.json")
    cp.set_defaults(func=_cmd_check_model)

    # Only listed here: `main` hands everything after "launch" to megatrain.commands.launch, whose options are torchrun's
    # and must not be parsed (or refused) by this parser.
    sub.add_parser("launch", add_help=False, help="run an unchanged training script or console command (and its "
                                                  "torchrun-style ranks) on MegaTrain: megatrain launch "
                                                  "[--nproc-per-node N ...] script.py args... | "
                                                  "llamafactory-cli train cfg.yaml")

    from .plan import add_bench_parser, add_plan_parser

    add_plan_parser(sub)
    add_bench_parser(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        from .launch import main as launch_main

        return launch_main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
