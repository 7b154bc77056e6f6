"""Sweep specs: YAML -> a validated list of points.

Every check runs at load time so a typo in a spec costs nothing: the error names the file, the key
(as a path such as ``grid.micro_batch[1]``) and the reason, before any model is built.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatrain.config.schema import EngineConfig
from megatrain.config.validate import close_match, is_int, unknown_key
from megatrain.models.presets import ModelPreset
from megatrain.planner import is_model_path, resolve_model

BACKENDS = ("megatrain", "zero3", "zero3-alst", "torch")
PRECISIONS = ("fp32", "bf16")

# Keys a point may set (in `defaults`, a grid or an explicit point) and their defaults.
POINT_DEFAULTS: dict[str, Any] = {
    "backend": None,
    "model": None,
    "seq_len": None,
    "micro_batch": 1,
    "grad_accum": 1,
    "precision": "fp32",
    "recompute": True,  # HF gradient checkpointing for torch/zero3; megatrain always recomputes per layer
    # megatrain engine knobs (EngineConfig fields; `residency`: "auto", "stream" or {weights, activations}, to
    # compare placements); ignored by the other backends
    "engine": {},
    # DeepSpeed `zero_optimization` overrides for backend zero3 (bucket, prefetch, persistence sizes);
    # empty: the baseline's documented offload tuning (baselines/zero3.py). Ignored by other backends.
    "zero3": {},
    "max_positions": None,  # override of the preset's limit, needed for context beyond it
    "warmup": 1,
    "steps": 3,  # timed steps; the median is reported
    "timeout_s": 600.0,
    "threads": None,  # torch intra-op threads in the point's process; None keeps torch's default
    "seed": 0,
    "lr": 1e-4,
    "grad_clip": 1.0,  # clip the global grad norm every step (DeepSpeed's default); 0 turns it off
}
_TOP_KEYS = ("name", "description", "defaults", "grid", "grids", "points")
# Fields that decide what a point measures; the timeout does not, so raising a timeout does not
# make finished points run again.
_IDENTITY_KEYS = ("backend", "model", "seq_len", "micro_batch", "grad_accum", "precision", "recompute",
                  "engine", "max_positions", "warmup", "steps", "seed", "lr", "grad_clip", "threads")


class SpecError(ValueError):
    """A sweep spec is invalid; the message names file, key and reason."""

    def __init__(self, file: str | Path, key: str, reason: str) -> None:
        self.file, self.key, self.reason = str(file), key, reason
        super().__init__(f"{file}: {key}: {reason}")


@dataclass(frozen=True)
class Point:
    backend: str
    model: str
    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    precision: str = "fp32"
    recompute: bool = True
    engine: dict = field(default_factory=dict)
    max_positions: int | None = None
    warmup: int = 1
    steps: int = 3
    timeout_s: float = 600.0
    threads: int | None = None
    seed: int = 0
    lr: float = 1e-4
    grad_clip: float = 1.0
    zero3: dict = field(default_factory=dict)

    @property
    def preset(self) -> ModelPreset:
        p = resolve_model(self.model)  # a preset name, or a local model directory / config.json: its shape
        return p.with_(max_positions=self.max_positions) if self.max_positions else p

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum

    @property
    def point_id(self) -> str:
        """Stable id of what is measured: the key used to skip points already recorded."""
        ident = {k: getattr(self, k) for k in _IDENTITY_KEYS}
        if self.zero3:  # only when set, so points recorded before the key existed keep their ids
            ident["zero3"] = self.zero3
        blob = json.dumps(ident, sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        s = f"{self.backend}/{self.model}/s{self.seq_len}/b{self.micro_batch}"
        if self.grad_accum != 1:
            s += f"x{self.grad_accum}"
        s += f"/{self.precision}"
        if not self.recompute and self.backend != "megatrain":
            s += "/norecompute"
        if self.engine and self.backend == "megatrain":
            s += "/" + ",".join(f"{k}={v}" for k, v in sorted(self.engine.items()))
        if self.zero3 and self.backend.startswith("zero3"):
            s += "/" + ",".join(f"{k}={v}" for k, v in sorted(self.zero3.items()))
        return s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Point:
        return cls(**d)


@dataclass
class Sweep:
    name: str
    file: str
    description: str
    points: list[Point]


def _did_you_mean(key: str, known: list[str] | tuple[str, ...]) -> str:
    close = close_match(key, known)
    return f" (did you mean {close!r}?)" if close else ""


def _absolute(path: str) -> str:
    """A path the spec names, against the caller's working directory: a point runs in a process of its own,
    working elsewhere (experiments/execute.py), where a relative path would mean another file."""
    return os.path.abspath(os.path.expanduser(path))


def _check_value(file: str, path: str, key: str, v: Any) -> Any:
    """Validate one key's value on its own; return the normalized value."""

    def bad(reason: str) -> SpecError:
        return SpecError(file, path, reason)

    if key == "backend":
        if v not in BACKENDS:
            raise bad(f"unknown backend {v!r}{_did_you_mean(str(v), BACKENDS)}; known: {', '.join(BACKENDS)}")
    elif key == "model":
        if not isinstance(v, str):
            raise bad(f"model must be a preset name or a local model directory / config.json, got {v!r}")
        try:
            resolve_model(v)
        except ValueError as e:
            raise bad(str(e)) from None
        if is_model_path(v):
            v = _absolute(v)
    elif key in ("seq_len", "micro_batch", "grad_accum", "steps"):
        if not is_int(v) or v < 1:
            raise bad(f"{key} must be a positive integer, got {v!r}")
    elif key in ("warmup", "seed"):
        if not is_int(v) or v < 0:
            raise bad(f"{key} must be a non-negative integer, got {v!r}")
    elif key == "max_positions":
        if v is not None and (not is_int(v) or v < 1):
            raise bad(f"max_positions must be a positive integer (or null), got {v!r}")
    elif key == "threads":
        if v is not None and (not is_int(v) or v < 1):
            raise bad(f"threads must be a positive integer (or null), got {v!r}")
    elif key in ("timeout_s", "lr"):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise bad(f"{key} must be a positive number, got {v!r}")
        v = float(v)
    elif key == "grad_clip":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise bad(f"grad_clip must be a number >= 0 (0: no clipping), got {v!r}")
        v = float(v)
    elif key == "precision":
        if v not in PRECISIONS:
            raise bad(f"precision must be one of {', '.join(PRECISIONS)}, got {v!r}")
    elif key == "recompute":
        if not isinstance(v, bool):
            raise bad(f"recompute must be true or false, got {v!r}")
    elif key == "engine":
        if not isinstance(v, dict):
            raise bad(f"engine must be a mapping of megatrain settings, got {v!r}")
        try:
            EngineConfig.from_dict(v)  # residency included (costs/residency.py parse)
        except (ValueError, TypeError) as e:
            raise bad(str(e)) from None
        v = dict(sorted(v.items()))
        if isinstance(v.get("nvme_path"), str):
            v["nvme_path"] = _absolute(v["nvme_path"])
    elif key == "zero3":
        if not isinstance(v, dict):
            raise bad(f"zero3 must be a mapping of DeepSpeed zero_optimization settings, got {v!r}")
        for name in ("stage", "offload_param", "offload_optimizer"):
            if name in v:
                raise bad(f"zero3.{name} is fixed by the zero3 backend (stage 3, params and optimizer on the CPU); "
                          "remove it")
        v = dict(sorted(v.items()))
    return v


def _check_keys(file: str, path: str, d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise SpecError(file, path, f"must be a mapping, got {type(d).__name__}")
    found = unknown_key(d, POINT_DEFAULTS)
    if found:
        k, close = found
        hint = f" (did you mean {close!r}?)" if close else ""
        raise SpecError(file, f"{path}.{k}" if path else str(k), f"unknown key{hint}; known: {', '.join(POINT_DEFAULTS)}")
    return d


def _axis_values(key: str, v: Any) -> tuple[list[Any], bool]:
    """A grid value is an axis when it is a list (for `engine`, a list of mappings)."""
    if isinstance(v, list):
        return v, True
    return [v], False


def _finish_point(file: str, merged: dict[str, Any], where: dict[str, str]) -> Point:
    """Cross-key checks on a complete point; `where` maps a key to the spec path it came from."""
    for req in ("backend", "model", "seq_len"):
        if merged.get(req) is None:
            raise SpecError(file, where.get("_point", "points"), f"missing required key {req!r}")
    if merged["backend"] != "megatrain":
        # Engine knobs mean nothing to the baselines; dropping them keeps one identity (and one
        # run) per baseline point when a spec sweeps a knob for megatrain.
        merged["engine"] = {}
    if not merged["backend"].startswith("zero3"):  # zero3-alst is ZeRO-3 too: the same overrides
        merged["zero3"] = {}
    if merged["backend"] == "megatrain":
        merged["recompute"] = True  # the engine always recomputes each layer in backward
    pt = Point(**merged)
    limit = pt.preset.max_positions
    if pt.seq_len > limit:
        reason = (f"seq_len {pt.seq_len} exceeds max_positions {limit} of model {pt.model!r}; "
                  "set max_positions to override")
        raise SpecError(file, where.get("seq_len", "seq_len"), reason)
    return pt


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep spec; raises SpecError on the first problem."""
    file = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(file, "<file>", "no such file") from None
    except yaml.YAMLError as e:
        raise SpecError(file, "<yaml>", f"not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SpecError(file, "<top>", "a sweep spec must be a mapping with `grid`, `grids` or `points`")
    found = unknown_key(raw, _TOP_KEYS)
    if found:
        raise SpecError(file, str(found[0]), f"unknown top-level key{_did_you_mean(str(found[0]), _TOP_KEYS)}; "
                                             f"known: {', '.join(_TOP_KEYS)}")
    name = raw.get("name") or Path(path).stem
    if not isinstance(name, str) or not name or "/" in name:
        raise SpecError(file, "name", f"must be a non-empty string without '/', got {name!r}")

    defaults = dict(POINT_DEFAULTS)
    for k, v in _check_keys(file, "defaults", raw.get("defaults") or {}).items():
        defaults[k] = _check_value(file, f"defaults.{k}", k, v)
    default_where = {k: f"defaults.{k}" for k in (raw.get("defaults") or {})}

    grids: list[tuple[str, dict]] = []
    if "grid" in raw:
        grids.append(("grid", raw["grid"]))
    if "grids" in raw:
        if not isinstance(raw["grids"], list):
            raise SpecError(file, "grids", "must be a list of grid mappings")
        grids += [(f"grids[{i}]", g) for i, g in enumerate(raw["grids"])]
    explicit = raw.get("points") or []
    if not isinstance(explicit, list):
        raise SpecError(file, "points", "must be a list of point mappings")
    if not grids and not explicit:
        raise SpecError(file, "<top>", "the spec defines no points: add `grid`, `grids` or `points`")

    points: list[Point] = []
    for gpath, grid in grids:
        _check_keys(file, gpath, grid)
        axes: list[tuple[str, list[tuple[Any, str]]]] = []
        for k, v in grid.items():
            values, is_axis = _axis_values(k, v)
            if is_axis and not values:
                raise SpecError(file, f"{gpath}.{k}", "an empty list gives no points")
            checked = []
            for i, item in enumerate(values):
                p = f"{gpath}.{k}[{i}]" if is_axis else f"{gpath}.{k}"
                checked.append((_check_value(file, p, k, item), p))
            axes.append((k, checked))
        for combo in itertools.product(*(vals for _, vals in axes)):
            merged = dict(defaults)
            where = {**default_where, "_point": gpath}
            for (k, _), (val, p) in zip(axes, combo):
                merged[k], where[k] = val, p
            points.append(_finish_point(file, merged, where))
    for i, pd in enumerate(explicit):
        ppath = f"points[{i}]"
        _check_keys(file, ppath, pd)
        merged = dict(defaults)
        where = {**default_where, "_point": ppath}
        for k, v in pd.items():
            merged[k] = _check_value(file, f"{ppath}.{k}", k, v)
            where[k] = f"{ppath}.{k}"
        points.append(_finish_point(file, merged, where))

    # Two spellings of one point (e.g. a grid and an explicit entry) run once.
    seen: dict[str, Point] = {}
    for pt in points:
        seen.setdefault(pt.point_id, pt)
    return Sweep(name=name, file=file, description=str(raw.get("description") or ""),
                 points=list(seen.values()))


def parse_only(filters: list[str] | None) -> dict[str, set[str]]:
    """`--only backend=torch,zero3 --only model=tiny` -> {backend: {...}, model: {...}}."""
    out: dict[str, set[str]] = {}
    for f in filters or []:
        for part in f.split(";"):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"--only {part!r}: expected KEY=VALUE[,VALUE...], e.g. backend=torch")
            k, vals = part.split("=", 1)
            k = k.strip()
            if k not in POINT_DEFAULTS and k != "point_id":
                raise ValueError(f"--only {part!r}: unknown key {k!r}{_did_you_mean(k, list(POINT_DEFAULTS))}")
            out.setdefault(k, set()).update(v.strip() for v in vals.split(",") if v.strip())
    return out


def select(points: list[Point], only: dict[str, set[str]]) -> list[Point]:
    def match(pt: Point) -> bool:
        for k, allowed in only.items():
            v = pt.point_id if k == "point_id" else getattr(pt, k)
            text = json.dumps(v, sort_keys=True) if isinstance(v, dict) else str(v)
            if isinstance(v, bool):
                text = text.lower()
            if text not in allowed and str(v) not in allowed:
                return False
        return True

    return [p for p in points if match(p)]


def load_point_config(path: str | Path, overrides: list[str] | None = None) -> Point:
    """One point from a YAML mapping (the `megatrain train` config), validated like a sweep point.
    `overrides` are KEY=VALUE strings whose values are parsed as YAML."""
    file = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise SpecError(file, "<file>", "no such file") from None
    except yaml.YAMLError as e:
        raise SpecError(file, "<yaml>", f"not valid YAML: {e}") from None
    raw = dict(_check_keys(file, "", raw))
    where: dict[str, str] = {"_point": "<top>"}
    for item in overrides or []:
        if "=" not in item:
            raise SpecError(file, "--set", f"{item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        raw[k.strip()] = yaml.safe_load(v)
        where[k.strip()] = f"--set {k.strip()}"
    _check_keys(file, "", raw)
    merged = dict(POINT_DEFAULTS)
    merged["warmup"] = 0  # a training run times every step it reports
    for k, v in raw.items():
        merged[k] = _check_value(file, where.get(k, k), k, v)
        where.setdefault(k, k)
    return _finish_point(file, merged, where)
