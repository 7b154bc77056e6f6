"""The harness's one entry for the `megatrain` command: `sweep`, `report` and `train POINT.yaml` (one benchmark point).

`megatrain/commands/cli.py` owns the options and calls these functions; it imports nothing else of experiments/.
Every path a user names (the spec, --out, a report's folder, a model directory inside the spec) is made absolute
here, against the caller's working directory, before any point's process starts: a point runs in a process of its
own that works elsewhere (experiments/execute.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _absolute(path: str | None) -> Path | None:
    return None if path is None else Path(path).expanduser().absolute()


def sweep(args: argparse.Namespace) -> int:
    """`megatrain sweep SPEC`: every selected point not yet recorded, one row each; 2 on a bad spec or option."""
    from experiments.executors import ExecutorError, make_executor
    from experiments.runner import run_sweep
    from experiments.spec import SpecError, load_sweep, parse_only

    try:
        spec = load_sweep(args.spec)
        only = parse_only(args.only)
        executor = make_executor(args.executor, address=args.address, cluster_cpus=args.cluster_cpus,
                                 cpus_per_point=args.cpus_per_point, gpus_per_point=args.gpus_per_point,
                                 partition=args.partition)
    except (SpecError, ValueError, ExecutorError) as e:
        print(f"megatrain sweep: error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_sweep(spec, out_dir=_absolute(args.out), only=only, force=args.force,
                            retry_failed=args.retry_failed, dry_run=args.dry_run, progress=not args.no_progress,
                            executor=executor)
    except ExecutorError as e:
        print(f"megatrain sweep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmegatrain sweep: interrupted; the points in flight were stopped and not recorded. "
              "Run the same command again to continue.", file=sys.stderr)
        return 130
    if args.report and not args.dry_run and summary.csv.exists():
        from experiments.report import write_report

        print(f"report: {write_report(summary.out_dir)}")
    return 0


def report(args: argparse.Namespace) -> int:
    """`megatrain report DIR`: report.md and its figures; with --notebook, the figures notebook run on DIR too."""
    from experiments.report import FIGURES, write_report

    src, out = _absolute(args.dir), _absolute(args.out)
    try:
        md = write_report(src, out_dir=out)
    except FileNotFoundError as e:
        print(f"megatrain report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {md}")
    for stem in FIGURES:
        print(f"wrote {md.parent / (stem + '.png')}")
    if getattr(args, "notebook", False):
        from experiments.notebook import NotebookError, run_notebook

        try:
            written = run_notebook(src if src.is_dir() else src.parent, md.parent / "notebook")
        except NotebookError as e:
            print(f"megatrain report: error: {e}", file=sys.stderr)
            return 2
        for path in written:
            print(f"wrote {path}")
    return 0


def run_point(args: argparse.Namespace) -> int:
    """`megatrain train POINT.yaml`: one benchmark point, in this process, with a progress bar."""
    from tqdm import tqdm

    from experiments.point import run
    from experiments.spec import SpecError, load_point_config

    try:
        # --model: a JSON string is a YAML string, so any path reads back as written
        model = [f"model={json.dumps(args.model)}"] if args.model else []
        pt = load_point_config(args.config, overrides=[*(args.set or []), *model])
    except (SpecError, ValueError) as e:
        print(f"megatrain train: error: {e}", file=sys.stderr)
        return 2
    total = pt.warmup + pt.steps
    bar = tqdm(total=total, desc=pt.label, unit="step", dynamic_ncols=True)

    def progress(info: dict) -> None:
        mem = f"rss {info['rss_bytes'] / 2**30:.2f}G"
        if info.get("device_bytes") is not None:
            mem += f" dev {info['device_bytes'] / 2**30:.2f}G"
        bar.set_postfix_str(f"loss {info['loss']:.4f} | {info['tokens_per_s']:.0f} tok/s | {mem}"
                            + ("" if info["timed"] else " | warm-up"))
        bar.update(1)

    try:
        row = run(pt, trace_path=args.trace, progress=progress)
    finally:
        bar.close()
    print(f"{pt.label}: loss {row['loss_first']:.4f} -> {row['loss_last']:.4f}; median step {row['step_time_s']:.3f} s, "
          f"{row['tokens_per_s']:.1f} tokens/s, {row['model_tflops']:.3g} model TFLOPS "
          f"(MFU {row['mfu']:.1%} of {row['device_peak_tflops']:.3g}, {row['peak_source']}); "
          f"peak RSS {row['peak_host_rss_bytes'] / 2**30:.2f} GiB")
    return 0
