"""What a run saves to resume, in the two layouts the faces promise, with one RNG saver for both.

- The DeepSpeed face's checkpoint: one crash-consistent tag directory (`megatrain.run.checkpoint`) holding the
  weights (`model.*`), optimizer tensors (`optim.*`), RNG streams (`rng.*`) and pickled client state
  (`client.*`) in its safetensors file; counters, config, LR schedule and the rest in its meta.json.
- The Accelerate face's folder, under accelerate's own file names: `model.safetensors` and `optimizer.bin`
  (what the MegaTrain backend writes), `scheduler*.bin`, `custom_checkpoint_*.pkl`, `sampler.bin`,
  `random_states_0.pkl` and the face's `accelerator.json`.

Both faces take the weights and optimizer state from the backend (`MegatrainBackend.training_state`) and
the RNG streams from `rng_state()` here; only the encoding differs.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..costs.advice import PlacementAdvice
from ..costs.residency import Residency
from ..files.tensor_file import TensorFile, TensorFiles
from . import checkpoint as ckpt

# ---------------------------------------------------------------------------------------------------
# RNG streams

def rng_state() -> dict[str, Any]:
    """Every RNG stream a training step draws from: torch (CPU and each CUDA device), Python, numpy."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# ---------------------------------------------------------------------------------------------------
# the residency a run chose

RESIDENCY_KEY = "residency"  # in a DeepSpeed-face checkpoint's meta; the Accelerate folder's RESIDENCY_FILE


def residency_record(engine: Any) -> dict[str, Any]:
    """What `engine` placed on its device when it was built and what decides its bits: how many of the first
    layers (and whether the embedding/norm/head) update there. On a GPU those update with torch's AdamW, the rest
    with the host's kernel, and "auto" sized the count from the free memory at the start, so the same run resumed
    on a card with other free memory would train other bits unless it places the same count (CheckpointResidency).
    Which layers keep their weights or graphs is planned per batch and changes no bit: not recorded."""
    return {"optimizer_layers": len(engine.optimizer_layers), "globals_on_device": bool(engine.globals_on_device),
            "layers": len(engine.store.layers), "device": engine.device.type}


def saved_residency(saved: dict[str, Any] | str | Path) -> dict[str, Any] | None:
    """The residency record a checkpoint holds (a DeepSpeed-face meta, or an Accelerate-face folder), None for one
    written before records were."""
    if isinstance(saved, dict):
        record = saved.get(RESIDENCY_KEY)
    else:
        path = Path(saved) / RESIDENCY_FILE
        record = json.loads(path.read_text()) if path.is_file() else None
    return None if record is None else dict(record)


class CheckpointResidency:
    """The placement advisor (costs/advice.py PlacementAdvice) of an engine resuming a run: residency "auto" places
    the optimizer-resident count the checkpoint's run chose at its start (`record`, residency_record's), not what
    this device's free memory would choose now; the per-batch placement (kept weights and graphs, bit-neutral) is
    `inner`'s (the planner's advisor, when the backend has one), else the engine's own fill. A count this device
    cannot hold fails as any placement that does not fit: an out-of-memory error lowers the kept weights and graphs
    around it (engine/runtime/oom.py), never this count, which the bits depend on."""

    def __init__(self, record: dict[str, Any], inner: PlacementAdvice | None = None) -> None:
        count = record.get("optimizer_layers")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"a checkpoint's residency record needs optimizer_layers as an int >= 0, got {record!r}")
        self.optimizer, self.inner = count, inner
        self.source = "from checkpoint"

    def optimizer_layers(self, config: Any, budget: int) -> int:
        return self.optimizer

    def residency(self, config: Any, tokens: int, budget: int, optimizer: int) -> Residency | None:
        return None if self.inner is None else self.inner.residency(config, tokens, budget, optimizer)


def resumed_residency(engine: Any, record: dict[str, Any] | None) -> str | None:
    """Why `engine`, loading a checkpoint whose run chose `record`, will not train that run's bits (its
    optimizer-resident count differs), or None when it places the same (or the checkpoint has no record)."""
    if record is None:
        return None
    now = residency_record(engine)
    if now["optimizer_layers"] == record.get("optimizer_layers"):
        return None
    return (f"the checkpoint's run updated {record.get('optimizer_layers')} layers on its device, this engine "
            f"{now['optimizer_layers']}: their updates round differently (the device's AdamW, the host's), so the "
            f"steps from here differ in their last bits from the run's own; build the engine with "
            f"placement_advice=CheckpointResidency(record) (run/train_state.py) to place as the run did")


# ---------------------------------------------------------------------------------------------------
# the Accelerate face's folder

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.bin"  # accelerate's name
RESIDENCY_FILE = "megatrain_residency.json"  # the residency the run chose (residency_record)

def write_weights(directory: str | Path, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                  residency: dict[str, Any] | None = None) -> None:
    """The weights and optimizer state; `residency` (the engine's `residency_record`) beside them."""
    d = Path(directory)
    ckpt.write_safetensors(d / MODEL_FILE, weights)
    torch.save(optimizer_state, d / OPTIMIZER_FILE)
    if residency is not None:
        ckpt.write_json(d / RESIDENCY_FILE, dict(residency))


def read_weights(directory: str | Path, engine: Any = None) -> tuple[Mapping[str, torch.Tensor], dict[str, Any]]:
    """(the weights, read one at a time as load_state_dict asks for them; the optimizer's state_dict). A sharded
    optimizer state (`write_weights_sharded`) is read for `engine`'s optimizer: only the parameters this rank
    keeps, each tensor into the optimizer's own where it has one."""
    d = Path(directory)
    weights = _Prefixed(TensorFile(d / MODEL_FILE), "")
    saved = torch.load(d / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if SHARDED_KEY not in saved:
        return weights, saved
    if engine is None:
        raise ValueError(f"{d / OPTIMIZER_FILE} lists optimizer shard files: read it with the engine it loads into")
    files: list[TensorFile] = []
    try:
        for name, want in sorted(saved["shards"].items()):
            path = d / name
            if not path.is_file():
                raise ckpt.CheckpointError(f"{path}: missing (listed in {d / OPTIMIZER_FILE})")
            files.append(TensorFile(path))
            if files[-1].sha256() != (want["bytes"], want["sha256"]):
                raise ckpt.CheckpointError(f"{path}: truncated or corrupt (size or sha256 differs from what its "
                                           f"writer reported in {d / OPTIMIZER_FILE})")
        state = optimizer_from(saved, TensorFiles(files), into=engine.optimizer, skip=foreign_params(engine))
    finally:
        for f in files:
            f.close()
    return weights, state


SHARDED_KEY = "megatrain_sharded"  # in an Accelerate-face optimizer.bin: the state is in the listed shard files
ACC_SHARD = "optimizer_shard_{}.safetensors"


def write_weights_sharded(directory: str | Path | None, weights: dict[str, torch.Tensor],
                          optimizer: torch.optim.Optimizer, mine: set[int], rank: int, group: Any) -> None:
    """The Accelerate face's data-parallel save with no gather of optimizer state (one host store per node):
    every rank writes the state of the parameters in `mine` (`shard_params`) to a shard file of its own in
    rank 0's `directory` (None on the others), and sends rank 0 only its size, hash and layout; rank 0 writes
    the weights, then optimizer.bin listing every shard: without it (or with a shard that differs from its
    entry) the folder does not load. Every rank calls it; each raises if any shard failed."""
    import torch.distributed as dist

    where = [str(directory) if rank == 0 else None]
    dist.broadcast_object_list(where, src=0, group=group)
    d = Path(where[0])

    def write(shard: dict[str, torch.Tensor]) -> tuple[str, dict[str, Any]]:
        name = ACC_SHARD.format(rank)
        size, sha = ckpt.write_safetensors_hashed(d / name, shard)
        return name, {"bytes": size, "sha256": sha}

    _, layout, reports = _exchange_shards(optimizer, mine, rank, group, write)
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            state, shards = _merged_shards(reports, f"optimizer state not saved in {d}")
            ckpt.write_safetensors(d / MODEL_FILE, weights)
            torch.save({SHARDED_KEY: 1, "optimizer": {"state": state, "param_groups": layout["param_groups"]},
                        "shards": shards}, d / OPTIMIZER_FILE)
        except Exception as e:
            outcome[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0] is not None:
        raise ckpt.CheckpointError(f"the state in {d} was not saved ({outcome[0]})")


def _exchange_shards(optimizer: torch.optim.Optimizer, mine: set[int], rank: int, group: Any,
                     write: Callable[[dict[str, torch.Tensor]], tuple[str, Any]] | None,
                     ) -> tuple[Any, dict[str, Any], list[Any] | None]:
    """This rank's optimizer state of the parameters in `mine`, its tensors written by `write` (when given and
    there are any) to a shard file of its own; every rank's layout and shard entry gathered on rank 0 (None
    elsewhere). A failed write becomes the report's error, so rank 0 publishes nothing and every rank raises."""
    import torch.distributed as dist

    local = local_optimizer_state(optimizer, mine)
    shard: dict[str, torch.Tensor] = {}
    layout = _optimizer_state(local, shard)
    report: dict[str, Any] = {"entries": layout["state"]}
    if write is not None and shard:
        try:
            report["shard"] = write(shard)
        except Exception as e:
            report["error"] = f"rank {rank}: {type(e).__name__}: {e}"
    reports: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(report, reports, dst=0, group=group)
    return local, layout, reports


def _merged_shards(reports: list[Any], what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """On rank 0: every rank's optimizer-state layout as one, in parameter order, and the shard files by name;
    raises naming the ranks whose shard failed."""
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise ckpt.CheckpointError(f"{what}: a shard failed ({'; '.join(errors)})")
    state: dict[str, Any] = {}
    for r in reports:
        for idx, entry in r["entries"].items():
            state.setdefault(idx, entry)
    return dict(sorted(state.items(), key=lambda kv: int(kv[0]))), dict(r["shard"] for r in reports if "shard" in r)


# ---------------------------------------------------------------------------------------------------
# the DeepSpeed face's checkpoint

ENGINE_CKPT_KIND = "megatrain.deepspeed_engine"
_MODEL = "model."
_OPTIM = "optim."
_CLIENT = "client."
_RNG = "rng."


def save_engine_checkpoint(save_dir: str | Path, tag: str, *, weights: dict[str, torch.Tensor],
                           optimizer_state: dict[str, Any] | None, scheduler: Any, counters: dict[str, int],
                           config: Any, client_state: dict[str, Any] | None, write: bool,
                           keep_last: int | None = None, update_latest: bool = True,
                           residency: dict[str, Any] | None = None) -> None:
    """Encode a DeepSpeed-face checkpoint and, when `write` (the rank that writes for all), publish it.
    `residency`: the engine's `residency_record`, for a resume to place as this run did."""
    tensors, meta = _engine_tensors_and_meta(weights, scheduler, counters, config, client_state, residency)
    if optimizer_state is not None:
        meta["optimizer"] = _optimizer_state(optimizer_state, tensors)
    if write:
        ckpt.save(save_dir, tag, tensors, meta, keep_last=keep_last, update_latest=update_latest)


def _engine_tensors_and_meta(weights: dict[str, torch.Tensor], scheduler: Any, counters: dict[str, int], config: Any,
                             client_state: dict[str, Any] | None, residency: dict[str, Any] | None = None
                             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {_MODEL + name: t for name, t in weights.items()}
    meta: dict[str, Any] = {"kind": ENGINE_CKPT_KIND, "version": 1, "counters": counters, "config": config,
                            "lr_scheduler": _scheduler_state(scheduler)}
    if residency is not None:
        meta[RESIDENCY_KEY] = dict(residency)
    meta["rng"] = _rng_state(tensors)
    meta["client_state"] = _split_client_state(client_state or {}, tensors)
    return tensors, meta


def local_optimizer_state(optimizer: torch.optim.Optimizer, mine: set[int]) -> dict[str, Any]:
    """`optimizer.state_dict()` as torch lays it out (parameters numbered across the groups), holding the state
    of the parameters whose ids are in `mine` only, taken here without any collective."""
    state, groups, i = {}, [], 0
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + len(g["params"])))})
        for p in g["params"]:
            if id(p) in mine and p in optimizer.state:
                state[i] = optimizer.state[p]
            i += 1
    return {"state": state, "param_groups": groups}


def shard_params(engine: Any) -> set[int] | None:
    """Ids of the parameters whose optimizer state this rank writes in a sharded save: with one host store per
    node, the layers it owns on the first node (every node holds the same); with nodes sharing one store (each node
    its own block of layers, parallel/shared_store.py), the layers it owns on every node; and on rank 0 the resident
    parameters. None where a save is not sharded (one process, or each rank its own store: rank 0 writes)."""
    dp = getattr(engine, "dp", None)
    if dp is None or dp.node is None or dp.world_size < 2:
        return None
    store = engine.store
    mine: set[int] = set()
    # nodes sharing one store (one rank per node, or several: spans_nodes): each node's layers its own
    if dp.node.topo.node == 0 or any(getattr(dp.node, a, False) for a in ("shares_across_nodes", "spans_nodes")):
        mine = {id(p) for g in store.layers if g.owned for p in g.params}
    if dp.rank == 0:
        mine |= {id(p) for p in store.globals.params}
    return mine


def foreign_params(engine: Any) -> set[int]:
    """Ids of the parameters whose optimizer state this rank does not keep (layers another rank of its node
    owns): a load need not read theirs."""
    return {id(p) for g in engine.store.layers if not g.owned for p in g.params}


def save_engine_checkpoint_sharded(save_dir: str | Path, tag: str, *, weights: dict[str, torch.Tensor],
                                   optimizer: torch.optim.Optimizer, mine: set[int], rank: int,
                                   group: Any, scheduler: Any, counters: dict[str, int], config: Any,
                                   client_state: dict[str, Any] | None, keep_last: int | None = None,
                                   update_latest: bool = True, residency: dict[str, Any] | None = None) -> None:
    """A data-parallel save with no gather of optimizer state: every rank writes the state of the parameters in
    `mine` (its layers; rank 0 also the resident parameters') to a shard file of its own in the save's temp
    directory, and sends rank 0 only the shard's size, hash and state layout; rank 0 writes the weights and
    the rest, and the manifest that lists every shard, and publishes. Every rank calls it; each returns or
    raises the same outcome (a failed shard fails the save, and nothing is published)."""
    import torch.distributed as dist

    where: list[Any] = [str(ckpt.begin(save_dir, tag)) if rank == 0 else None]
    dist.broadcast_object_list(where, src=0, group=group)
    tmp = Path(where[0])

    def write(shard: dict[str, torch.Tensor]) -> tuple[str, Any]:
        name = f"{ckpt.SHARD_PREFIX}{rank}.safetensors"
        return name, ckpt.write_shard(tmp, name, shard)

    # Rank 0's own state goes into the main file with the weights, not a shard.
    local, _, reports = _exchange_shards(optimizer, mine, rank, group, write if rank != 0 else None)
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            state, shards = _merged_shards(reports, f"checkpoint {tag!r} not saved")
            tensors, meta = _engine_tensors_and_meta(weights, scheduler, counters, config, client_state, residency)
            main = _optimizer_state(local, tensors)
            meta["optimizer"] = {"state": state, "param_groups": main["param_groups"]}
            ckpt.publish(save_dir, tag, tmp, tensors, meta, shards=shards, keep_last=keep_last,
                         update_latest=update_latest)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0] is not None:
        raise ckpt.CheckpointError(f"checkpoint {tag!r} in {save_dir} was not saved ({outcome[0]})")


class _Prefixed(Mapping[str, torch.Tensor]):
    """The tensors under one prefix of a checkpoint's file, by their names without it, each read when asked
    for into one reused buffer (`TensorFile.read_transient`): a value is valid until the next is asked for,
    which is how a load_state_dict uses it (checked, then copied into the host store)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> None:
        self._tensors, self._prefix = tensors, prefix
        self._names = {k[len(prefix):]: None for k in tensors if k.startswith(prefix)}  # ordered, hashed

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        read = getattr(self._tensors, "read_transient", None)
        return read(self._prefix + name) if read is not None else self._tensors[self._prefix + name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_engine_checkpoint(load_dir: str | Path, tag: str | None
                           ) -> tuple[Mapping[str, torch.Tensor], dict[str, Any], Path, Mapping[str, torch.Tensor]]:
    """(weights, meta, path, tensors) of a DeepSpeed-face checkpoint, checksums verified. The weights and
    tensors are read from the file one at a time as they are asked for (checkpoint.load)."""
    tensors, meta, path = ckpt.load(load_dir, tag)
    if meta.get("kind") != ENGINE_CKPT_KIND:
        raise ckpt.CheckpointError(f"{path} is not a checkpoint written by MegaTrainEngine.save_checkpoint")
    return _Prefixed(tensors, _MODEL), meta, path, tensors


def optimizer_from(meta: dict[str, Any], tensors: Mapping[str, torch.Tensor],
                   into: torch.optim.Optimizer | None = None, skip: set[int] | None = None) -> dict[str, Any]:
    """The optimizer's state_dict from a checkpoint. With `into` (the optimizer it will be loaded into), each
    state tensor is read straight into that optimizer's own tensor for the parameter when it has one of the
    same shape and dtype (a reload holds no second copy), else into a new tensor that load_state_dict adopts
    as it is (same dtype and device as the parameter): either way one state tensor is in flight at a time.
    `skip`: ids of `into`'s parameters whose state this process does not keep (not read at all)."""
    m = meta["optimizer"]
    live: list[dict[str, Any]] = []
    skipped: set[int] = set()
    if into is not None:
        params = [p for g in into.param_groups for p in g["params"]]
        live = [into.state.get(p, {}) for p in params]
        skipped = {i for i, p in enumerate(params) if id(p) in (skip or ())}
    state = {}
    for idx, entry in m["state"].items():
        i = int(idx)
        if i in skipped:
            continue
        mine = live[i] if i < len(live) else {}
        state[i] = {k: _read_state(tensors, f"{_OPTIM}{idx}.{k}", mine.get(k)) if v == "__in_tensors__"
                    else _from_json_value(v) for k, v in entry.items()}
    groups = [{k: _from_json_value(v) for k, v in g.items()} for g in m["param_groups"]]
    return {"state": state, "param_groups": groups}


def _read_state(tensors: Mapping[str, torch.Tensor], name: str, current: Any) -> torch.Tensor:
    read_into = getattr(tensors, "read_into", None)
    if (read_into is not None and torch.is_tensor(current) and current.device.type == "cpu"
            and current.dtype == tensors.dtype(name) and tuple(current.shape) == tuple(tensors.shape(name))
            and current.is_contiguous()):
        return read_into(name, current)
    return tensors[name]


def restore_rng(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    _restore_rng(meta["rng"], tensors)


def client_state_from(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state = meta.get("client_state", {})
    if state.get("__pickled__"):
        # The checkpoint's own bytes, checksum-verified: the same trust DeepSpeed's torch.load gives them.
        return torch.load(io.BytesIO(tensors[_CLIENT + "pickle"].numpy().tobytes()), weights_only=False)
    # checkpoints written before client_state was pickled: JSON values and tensors
    return {k: tensors[f"{_CLIENT}{k}"] if v == "__in_tensors__" else v for k, v in state.items()}


def _json_value(v: Any, what: str) -> Any:
    if torch.is_tensor(v):
        if v.numel() != 1:
            raise TypeError(f"{what}: a non-scalar tensor where a hyper-parameter was expected")
        return {"__tensor__": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, tuple):
        return {"__tuple__": [_json_value(x, what) for x in v]}
    return v


def _from_json_value(v: Any) -> Any:
    if isinstance(v, dict) and "__tensor__" in v:
        return torch.tensor(v["__tensor__"], dtype=getattr(torch, v["dtype"]))
    if isinstance(v, dict) and "__tuple__" in v:
        return tuple(_from_json_value(x) for x in v["__tuple__"])
    return v


def _optimizer_state(sd: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state_meta: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        entry = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{_OPTIM}{idx}.{k}"] = v
                entry[k] = "__in_tensors__"
            else:
                entry[k] = _json_value(v, f"optimizer state {k}")
        state_meta[str(idx)] = entry
    groups = [{k: _json_value(v, f"param group {k}") for k, v in g.items()} for g in sd["param_groups"]]
    return {"state": state_meta, "param_groups": groups}


def _scheduler_state(sched: Any) -> Any:
    if sched is None or not hasattr(sched, "state_dict"):
        return None
    return {k: _json_value(v, f"lr scheduler {k}") for k, v in sched.state_dict().items()}


def _rng_state(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`rng_state()` split into the checkpoint's tensors and JSON meta."""
    state = rng_state()
    tensors[_RNG + "torch"] = state["torch"]
    for i, s in enumerate(state.get("cuda", [])):
        tensors[f"{_RNG}cuda.{i}"] = s
    version, mt_state, gauss = state["python"]
    out: dict[str, Any] = {"python": [version, list(mt_state), gauss], "cuda_devices": len(state.get("cuda", []))}
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        tensors[_RNG + "numpy"] = torch.from_numpy(keys.astype(np.int64))
        out["numpy"] = [kind, pos, has_gauss, cached]
    return out


def _restore_rng(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, mt_state, gauss = meta["python"]
    state: dict[str, Any] = {"torch": tensors[_RNG + "torch"], "python": (version, tuple(mt_state), gauss)}
    if meta.get("cuda_devices"):
        state["cuda"] = [tensors[f"{_RNG}cuda.{i}"] for i in range(meta["cuda_devices"])]
    if "numpy" in meta and _RNG + "numpy" in tensors:
        import numpy as np

        kind, pos, has_gauss, cached = meta["numpy"]
        state["numpy"] = (kind, tensors[_RNG + "numpy"].numpy().astype(np.uint32), pos, has_gauss, cached)
    set_rng_state(state)


def _split_client_state(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`client_state` as DeepSpeed keeps it: any picklable objects, pickled (torch.save) into one byte tensor, so
    tuples, namespaces and tensors come back as they went in, covered by the checkpoint's checksums."""
    buf = io.BytesIO()
    try:
        torch.save(dict(state), buf)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        for key, value in state.items():
            try:
                torch.save(value, io.BytesIO())
            except (pickle.PicklingError, TypeError, AttributeError):
                raise TypeError(f"client_state[{key!r}] cannot be saved ({e}); client_state must be picklable, "
                                "as DeepSpeed requires") from e
        raise TypeError(f"client_state cannot be saved ({e}); it must be picklable, as DeepSpeed requires") from e
    tensors[_CLIENT + "pickle"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return {"__pickled__": True}
