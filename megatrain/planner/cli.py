"""`megatrain plan`'s own part, and `python -m megatrain.planner`: the flags of one training point (or one
data-parallel job), and its plan printed: the first screen (summary.py), with --details every table (details.py), or
JSON. A sweep spec's rows (--sweep) and `megatrain bench` are the command's (megatrain/commands/plan.py): they read
the harness's spec format and measure this machine, neither of which is the planner's."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ..config.schema import auto_or
from ..costs import residency as kept
from .details import format_multi, format_plan
from .estimate import plan
from .hardware import load_profiles, resolve_hardware
from .host_work import host_assumptions
from .mode_table import mode_table
from .nvme_plan import format_nvme_rows, nvme_rows, with_nvme
from .partial import plan_partial
from .point import ENGINE_RESIDENCY, make_point, residency_setting
from .prediction import Plan
from .reference import torch_reference
from .search import largest_batch, largest_context
from .shapes import resolve_model
from .summary import first_screen, first_screen_multi, fits, fmt_seconds, nvme_added_s


def _switch(v: str) -> bool:
    v = v.lower()
    if v in ("on", "true", "1", "yes"):
        return True
    if v in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{v!r}: use on, off or auto")


def _auto(v: str) -> bool | str:
    return auto_or(v, _switch)


def _auto_int(v: str) -> int | str:
    return auto_or(v, int)


def _tile(v: str) -> int | str | None:
    return auto_or(v, lambda w: None if w.lower() in ("none", "off", "0") else int(w))


def _residency(v: str) -> str | kept.Residency:
    """--residency: auto, stream, W, W,A or the setting's JSON object."""
    return auto_or(v, _residency_counts)


def _residency_counts(v: str) -> kept.Residency:
    if v.lower() == kept.STREAM:
        return kept.parse(kept.STREAM)
    if v.lstrip().startswith("{"):  # as the config writes it, e.g. {"weights": 24, "activations": 24, "offload": 20}
        try:
            return kept.parse(json.loads(v))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{v!r}: {e}") from None
    try:
        counts = [int(x) for x in v.split(",")]
        if len(counts) > 2:
            raise ValueError
        return kept.Residency(*counts)
    except (TypeError, ValueError) as e:
        why = f" ({e})" if str(e) else ""
        raise argparse.ArgumentTypeError(f"{v!r}{why}: use auto, stream, W (kept weights) or W,A (kept weights, "
                                         "kept activations; A <= W)") from None


def add_plan_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="a local model directory (with config.json) or a config.json, or a preset name "
                                    "or alias (e.g. 120b, qwen2.5-14b); required (`megatrain plan` without --sweep)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1, help="micro-batch (sequences)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hardware", default="h200-pcie",
                    help="profile name (python -m megatrain.planner --list-hardware); with --sweep a comma list")
    ap.add_argument("--hardware-file", help="extra profiles YAML (e.g. `megatrain bench --out`)")
    ap.add_argument("--backend", default="megatrain", choices=["megatrain", "zero3", "zero3-alst", "torch"])
    ap.add_argument("--compare", default="zero3", help="also plan these backends (comma list; '' for none)")
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--offload-activations", type=_auto, default="auto", help="on, off or auto")
    ap.add_argument("--mlp-tile-tokens", "--tile-tokens", dest="mlp_tile_tokens", type=_tile, default="auto",
                    help="MLP sequence tile (EngineConfig.mlp_tile_tokens): int, none or auto; "
                         "--tile-tokens is a deprecated alias")
    ap.add_argument("--device-budget-gib", type=float,
                    help="device memory the engine's 'auto' plans against (EngineConfig.device_budget_bytes)")
    ap.add_argument("--loss-chunk-tokens", type=_auto_int, default="auto",
                    help="head/loss chunk (EngineConfig.loss_chunk_tokens): int or auto (the engine's policy)")
    ap.add_argument("--master", "--host-master", dest="master", default="auto",
                    choices=["auto", "fp32", "hilo", "bf16"],
                    help="host master weights (EngineConfig.host_master): auto (the default: the fastest exact mode "
                         "that fits, the NVMe tier last when the profile has a disk), fp32 (+bf16 shadow), hilo "
                         "(exact hi/lo split) or bf16 (the paper's code, not exact)")
    ap.add_argument("--host-grad-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="host gradient slabs (EngineConfig.host_grad_dtype; bfloat16: exact at accumulation 1; "
                         "auto: chosen with --master auto, else float32)")
    ap.add_argument("--optimizer-in-backward", action="store_true",
                    help="each layer's AdamW during backward, no layer gradient slab "
                         "(EngineConfig.optimizer_in_backward; no clipping, no accumulation)")
    ap.add_argument("--optimizer-overlap", type=_auto, nargs="?", const=True, default="auto",
                    help="on, off or auto (the default, as the engine: on with a CUDA device): the host AdamW a "
                         "layer at a time behind the next forward (EngineConfig.optimizer_overlap); alone: on")
    ap.add_argument("--residency", type=_residency, default=ENGINE_RESIDENCY,
                    help="layers kept on the device (EngineConfig.residency): auto (the planner's placement within "
                         "the device budget), stream (every layer streamed and recomputed), W[,A]: the first W "
                         "layers' weights kept, the first A of them keeping their activations, or the setting's JSON "
                         "object ({\"weights\": W, \"activations\": A, \"offload\": J, \"optimizer\": K}: the last J "
                         "of the A graphs offloaded to host memory); default: the "
                         f"engine's ({residency_setting(ENGINE_RESIDENCY)})")
    ap.add_argument("--link-gbs", type=float, help="override the link rate (GB/s per direction)")
    ap.add_argument("--host-memory-gib", type=float)
    ap.add_argument("--nvme-gbs", type=float, help="the NVMe tier's disk rate, GB/s each way (default: the profile's)")
    ap.add_argument("--nvme-gib", type=float, help="the NVMe tier's disk capacity, GiB (default: the profile's)")
    ap.add_argument("--device-memory-gib", type=float)
    ap.add_argument("--gpus-per-node", type=int, default=1,
                    help="data parallel: GPUs of one node training together, sharing its host store (at most the "
                         "profile's gpus_per_node)")
    ap.add_argument("--nodes", type=int, default=1, help="data parallel: nodes, each with its own host store")
    ap.add_argument("--network-gbs", type=float, help="override the node's network rate to other nodes (GB/s per "
                                                      "direction, all NICs together)")
    ap.add_argument("--gpus-per-host-link", type=int, help="override how many GPUs share one host link")
    ap.add_argument("--data-path", default="auto", choices=["auto", "node", "per-rank"],
                    help="several GPUs per node: the node path (a layer crosses the host link once per node, "
                         "NVLink all-gather; planned, docs/DISTRIBUTED.md) where the profile has NVLink (auto), or "
                         "today's per-rank path")
    ap.add_argument("--trainable", help="price partial training beside the full plan (one GPU, megatrain): a fraction "
                                        "of the decoder layers (0.25: the top quarter), top:K (the top K layers) "
                                        "or lora:R (rank-R adapters on q_proj and v_proj); the embedding and head "
                                        "frozen (planner/partial.py)")
    ap.add_argument("--details", action="store_true",
                    help="after the first screen, every table: memory by component, time per layer, the "
                         "timeline, the host modes and the NVMe tier")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--no-search", action="store_true", help="skip the largest batch/context searches")


def flag_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the flags set (EngineConfig's names; every one changes a prediction), as plan()'s
    keyword arguments."""
    budget = getattr(args, "device_budget_gib", None)
    engine = dict(num_buffers=args.num_buffers, offload_activations=args.offload_activations,
                  mlp_tile_tokens=args.mlp_tile_tokens, loss_chunk_tokens=args.loss_chunk_tokens,
                  host_master=args.master, host_grad_dtype=args.host_grad_dtype,
                  optimizer_overlap=args.optimizer_overlap, optimizer_in_backward=args.optimizer_in_backward,
                  device_budget_bytes=int(budget * 2**30) if budget else None)
    return {**engine, "grad_clip": not args.optimizer_in_backward,
            "residency": getattr(args, "residency", ENGINE_RESIDENCY)}


def _resolve_hw(args: argparse.Namespace, name: str | None = None) -> Any:
    name = name or args.hardware
    if args.hardware_file:
        extra = load_profiles(args.hardware_file)
        if name in extra:
            return extra[name]
    return name


def flag_profiles(args: argparse.Namespace) -> list[Any]:
    """--hardware's comma list, each a profile of --hardware-file or a name of the profiles file."""
    return [_resolve_hw(args, h.strip()) for h in args.hardware.split(",") if h.strip()]


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return dict(link_gbs=args.link_gbs, host_memory_gib=args.host_memory_gib,
                device_memory_gib=args.device_memory_gib)


def run_plan(args: argparse.Namespace) -> int:
    """The `plan` command; a bad name or value prints one error line and returns 2."""
    try:
        return _run_plan(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_plan(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model is required (or, with `megatrain plan`, --sweep SPEC)")
    if (args.gpus_per_node, args.nodes) != (1, 1):
        if getattr(args, "trainable", None):
            raise ValueError("--trainable prices one GPU's partial training; drop --gpus-per-node/--nodes with it")
        return _run_plan_multi(args)
    # the NVMe tier's disk (planner/nvme_plan.py) as the user gives it: host mode "auto" may choose the tier
    hw = with_nvme(resolve_hardware(_resolve_hw(args), args.link_gbs, args.host_memory_gib, args.device_memory_gib),
                   args.nvme_gbs, args.nvme_gib)
    knobs = flag_knobs(args)
    common = dict(context=args.context, batch=args.batch, grad_accum=args.grad_accum, dtype=args.dtype, hardware=hw)
    model = resolve_model(args.model)  # a model directory is read once, for every plan below
    main = plan(model, backend=args.backend, **common, **knobs)
    partial = plan_partial(main, args.trainable) if getattr(args, "trainable", None) else None
    others = []
    for b in [x.strip() for x in (args.compare or "").split(",") if x.strip()]:
        if b != args.backend:
            others.append(plan(model, backend=b, **common))
    bb = bc = None
    full = args.details or args.json  # the tables behind the first screen
    modes = (mode_table(main.point, main.hardware, search=not args.no_search)
             if args.backend == "megatrain" and full else None)
    if not args.no_search and full:
        bb, bc = largest_batch(main.point, main.hardware), largest_context(main.point, main.hardware)
    nvhw = with_nvme(main.hardware, args.nvme_gbs, args.nvme_gib)  # the NVMe tier (planner/nvme_plan.py)
    nvrows = nvme_rows(main.point, nvhw, search=not args.no_search) if args.backend == "megatrain" and full else []
    if args.json:
        d = main.to_dict()
        if partial is not None:
            d["partial"] = partial.to_dict()
        d["nvme"] = [dataclasses.asdict(r) for r in nvrows]
        ref = torch_reference(main)
        d.update(max_batch=bb, max_context=bc, compare=[o.to_row() for o in others],
                 modes=[{**dataclasses.asdict(r), "settings": r.settings} for r in modes or []],
                 torch_reference=None if ref is None else ref.to_row())
        if args.backend == "megatrain":
            d["settings"] = main.settings
            if not main.hardware.unified_memory:
                d["host_assumed"] = host_assumptions(main.point, main.hardware)  # as the text's `host assumed:` line
        print(json.dumps(d, indent=2, default=str))
    else:
        print("\n".join(first_screen(main, others, _nodes_hint(main, hw, args))))
        if partial is not None:
            print("\n".join(partial.lines()))
        if args.details:
            print(format_plan(main, bb, bc, others, modes))
    if nvrows and not args.json and args.details:
        print("\n".join(format_nvme_rows(nvrows, nvhw)))
    return 0


def _nodes_hint(pl: Plan, hw: Any, args: argparse.Namespace, gpus_per_node: int = 1) -> str | None:
    """Where the point does not fit one node's host memory (or fits only by spilling to NVMe): the fewest nodes
    that hold it sharing one store, with their step and the network's part (planner/multi.py)."""
    from .multi import node_hardware, smallest_store_nodes

    if pl.point.backend != "megatrain" or (fits(pl) and not nvme_added_s(pl)):
        return None
    node_hw = node_hardware(hw, args.network_gbs, args.gpus_per_host_link)
    if not node_hw.network_gbs:
        return None
    mp = smallest_store_nodes(pl.point, node_hw, gpus_per_node, data_path=args.data_path)
    if mp is None:
        return "no number of nodes up to 64 holds it in host memory (see --details)"
    return (f"--nodes {mp.nodes}{f' --gpus-per-node {gpus_per_node}' if gpus_per_node > 1 else ''}: the fewest "
            f"nodes that hold it in host memory, sharing one store ({mp.auto.mode.label}); step {fmt_seconds(mp.step_s)}, "
            f"of which the network carries {fmt_seconds(mp.comm.network_layers_s)} (overlapped in the pipeline)")


def _run_plan_multi(args: argparse.Namespace) -> int:
    """`plan --gpus-per-node N --nodes M`: the node's host memory, one GPU's device memory and the job's speed."""
    from .multi import node_hardware, plan_point_multi
    from .search import max_batch_multi, max_context_multi

    hw = node_hardware(resolve_hardware(_resolve_hw(args), args.link_gbs, args.host_memory_gib, args.device_memory_gib),
                       args.network_gbs, args.gpus_per_host_link)
    hw = with_nvme(hw, args.nvme_gbs, args.nvme_gib)
    knobs = flag_knobs(args)
    model = resolve_model(args.model)
    G, N = args.gpus_per_node, args.nodes

    def one(backend: str, kn: dict[str, Any]) -> Any:
        p = make_point(model, args.context, args.batch, args.grad_accum, args.dtype, backend, **kn)
        return plan_point_multi(p, hw, G, N, data_path=args.data_path)

    mp = one(args.backend, knobs if args.backend == "megatrain" else {})
    zero3 = None
    wanted = [x.strip() for x in (args.compare or "").split(",") if x.strip()]
    if args.backend == "megatrain" and "zero3" in wanted:
        zero3 = one("zero3", {})
    bb = bc = None
    if not args.no_search and args.details:
        bb = max_batch_multi(mp.rank.point, hw, G, N)
        bc = max_context_multi(mp.rank.point, hw, G, N)
    if mp.auto is not None:
        mp.rank.auto = mp.auto  # every "fits" of the details is the chosen mode's
    if args.json:
        d = mp.rank.to_dict()  # its "fits": memory and the engine together
        d.update(max_batch=bb, max_context=bc, data_parallel=mp.summary(),
                 compare=[zero3.summary()] if zero3 is not None else [])
        if mp.auto is not None:
            d["auto"] = mp.auto.to_dict()
        print(json.dumps(d, indent=2, default=str))
        return 0
    hint = _nodes_hint(mp.rank, hw, args, G) if mp.nodes == 1 else None
    print("\n".join(first_screen_multi(mp, zero3, hint)))
    if args.details:
        print(format_multi(mp, bb, bc, hw))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m megatrain.planner [plan] --model ...` or `python -m megatrain.planner --list-hardware`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--list-hardware", "list-hardware"):
        for name, hw in load_profiles().items():
            print(f"{name:<12} {hw.description}")
        return 0
    if argv and argv[0] == "bench":
        print("error: measuring this machine is `megatrain bench` (python -m megatrain.commands.cli bench)",
              file=sys.stderr)
        return 2
    if argv and argv[0] == "plan":
        argv = argv[1:]
    ap = argparse.ArgumentParser(prog="python -m megatrain.planner",
                                 description="Predict host/device memory per component, step time, throughput and "
                                             "fit of one training point (`megatrain plan` also plans a sweep spec).")
    add_plan_args(ap)
    return run_plan(ap.parse_args(argv))
