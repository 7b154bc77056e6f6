"""Sweeps beyond one machine: the Ray and Slurm (submitit) executors record the same rows as the
local runner, resume an interrupted sweep, and record a dead job as failed.

Real points run (the quick sweep's tiny model, megatrain and torch backends: a few seconds each).
One local Ray cluster serves the module; Slurm is stood in for by submitit's local executor, which
runs the very same job function in a process per job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import ray

from experiments import results as R
from experiments.executors import ExecutorError, make_executor
from experiments.executors.ray_exec import RayExecutor, check_address
from experiments.executors.slurm import SlurmExecutor, time_limit_min
from experiments.runner import run_sweep
from experiments.spec import load_sweep, select
from megatrain.commands.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
QUICK = load_sweep(REPO / "experiments" / "sweeps" / "quick.yaml")
ONLY = {"model": {"tiny"}, "backend": {"megatrain", "torch"}}

# Columns that measure this machine's speed, memory or free memory at the moment the point ran:
# they differ between any two runs. Every other column must match exactly.
VARYING = {
    "step_time_s", "step_time_min_s", "step_time_max_s", "step_times_s", "tokens_per_s", "model_tflops",
    "mfu", "forward_s", "backward_s", "optimizer_s", "copy_wait_s", "peak_host_rss_bytes",
    "base_host_rss_bytes", "host_bytes_per_param", "h2d_gbps", "d2h_gbps", "h2d_busy_s", "h2d_gbps_busy",
    "link_util", "wall_s", "available_host_bytes", "available_device_bytes", "timestamp",
    # measured once per machine and cached; points running at once may each measure it
    "device_peak_tflops", "link_peak_h2d_gbps",
}


def row_differences(expected: pd.DataFrame, got: pd.DataFrame) -> list[str]:
    """What differs between two result tables, by point: missing or extra points, and every
    deterministic column whose value differs. Empty when they agree."""
    a, b = expected.set_index("point_id"), got.set_index("point_id")
    out = [f"missing point {p}" for p in sorted(set(a.index) - set(b.index))]
    out += [f"extra point {p}" for p in sorted(set(b.index) - set(a.index))]
    for pid in sorted(set(a.index) & set(b.index)):
        for col in R.COLUMN_NAMES:
            if col == "point_id" or col in VARYING:
                continue
            x, y = a.at[pid, col], b.at[pid, col]
            if not ((pd.isna(x) and pd.isna(y)) or x == y):
                out.append(f"{pid} {col}: {x!r} != {y!r}")
    return out


def _quiet(*_: object) -> None:
    pass


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory) -> pd.DataFrame:
    out = tmp_path_factory.mktemp("local")
    summary = run_sweep(QUICK, out_dir=out, only=ONLY, progress=False, log=_quiet)
    df = R.read_rows(out / "results.csv")
    # The reference itself must be a real measurement, or matching it would prove nothing.
    assert len(df) == 2 and set(summary.statuses.values()) == {"ok"}, df[["label", "status", "reason"]]
    assert df["loss_last"].notna().all()
    return df


@pytest.fixture(scope="module")
def ray_cluster():
    # Started the way `--executor ray` without --address starts one (a cluster of our own, never
    # one another process on this machine started), then shared by every Ray test here.
    assert not ray.is_initialized()
    assert RayExecutor(cluster_cpus=2)._connect() is True
    assert ray.cluster_resources().get("CPU") == 2
    yield
    ray.shutdown()


def test_the_selection_is_two_points():
    assert sorted(p.label for p in select(QUICK.points, ONLY)) == ["megatrain/tiny/s128/b1/fp32",
                                                                   "torch/tiny/s128/b1/fp32"]


@pytest.mark.slow
def test_ray_resumes_an_interrupted_sweep_and_matches_the_local_rows(ray_cluster, local_rows, tmp_path):
    first, second = sorted(select(QUICK.points, ONLY), key=lambda p: p.label)
    out = tmp_path / "ray"
    # Interrupted after one point: only the first is recorded.
    s1 = run_sweep(QUICK, out_dir=out, only={**ONLY, "point_id": {first.point_id}}, progress=False, log=_quiet,
                   executor=RayExecutor())
    assert s1.ran == [first.point_id]
    before = R.read_rows(out / "results.csv")
    # The rerun runs only the missing point and leaves the recorded row as it was.
    s2 = run_sweep(QUICK, out_dir=out, only=ONLY, progress=False, log=_quiet, executor=RayExecutor())
    assert s2.ran == [second.point_id] and s2.skipped_recorded == [first.point_id]
    df = R.read_rows(out / "results.csv")
    assert len(R.read_rows(out / "results.csv", dedupe=False)) == 2
    assert df.set_index("point_id").at[first.point_id, "timestamp"] == before.at[0, "timestamp"]
    assert row_differences(local_rows, df) == []
    assert (out / df.set_index("point_id").at[second.point_id, "log_file"]).exists()
    # A third run has nothing left to do.
    assert run_sweep(QUICK, out_dir=out, only=ONLY, progress=False, log=_quiet, executor=RayExecutor()).ran == []


@pytest.mark.slow
def test_submitit_matches_the_local_rows(local_rows, tmp_path):
    out = tmp_path / "slurm"
    summary = run_sweep(QUICK, out_dir=out, only=ONLY, progress=False, log=_quiet,
                        executor=SlurmExecutor(cluster="local"))
    assert sorted(summary.ran) == sorted(local_rows["point_id"])
    assert row_differences(local_rows, R.read_rows(out / "results.csv")) == []
    assert any((out / "slurm").iterdir())  # submitit's per-job logs live under the results dir


@pytest.mark.slow
def test_comparison_detects_a_changed_loss_and_a_missing_point(local_rows):
    assert row_differences(local_rows, local_rows) == []
    changed = local_rows.copy()
    changed.loc[0, "loss_last"] = changed.loc[0, "loss_last"] * (1 + 1e-9)
    diffs = row_differences(local_rows, changed)
    assert len(diffs) == 1 and "loss_last" in diffs[0]
    failed = local_rows.copy()
    failed.loc[1, "status"] = "failed"
    assert any("status" in d for d in row_differences(local_rows, failed))
    missing = row_differences(local_rows, local_rows.iloc[:1])
    assert missing == [f"missing point {local_rows.at[1, 'point_id']}"]
    # the measured columns alone may differ
    timed = local_rows.copy()
    timed["step_time_s"] = timed["step_time_s"] * 2
    assert row_differences(local_rows, timed) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ray", "submitit"])
def test_a_job_that_dies_is_recorded_failed_and_can_be_retried(kind, request, tmp_path):
    if kind == "ray":
        request.getfixturevalue("ray_cluster")
    pt = select(QUICK.points, {**ONLY, "backend": {"torch"}})[0]
    only = {"point_id": {pt.point_id}}
    out = tmp_path / kind
    out.mkdir()
    (out / "logs").write_text("a file where the job needs its log directory")  # the job raises on its node

    def executor():
        return RayExecutor() if kind == "ray" else SlurmExecutor(cluster="local")

    run_sweep(QUICK, out_dir=out, only=only, progress=False, log=_quiet, executor=executor())
    row = R.read_rows(out / "results.csv").iloc[0]
    assert row["point_id"] == pt.point_id and row["status"] == "failed"
    assert "FileExistsError" in row["reason"], row["reason"]
    assert row["label"] == pt.label and row["backend"] == "torch"  # the point's own columns, as locally
    # A rerun skips it as recorded; --retry-failed runs it again (failing again: the fault is still
    # there) and keeps one row for it.
    assert run_sweep(QUICK, out_dir=out, only=only, progress=False, log=_quiet, executor=executor()).ran == []
    s = run_sweep(QUICK, out_dir=out, only=only, retry_failed=True, progress=False, log=_quiet, executor=executor())
    assert s.ran == [pt.point_id] and s.statuses == {pt.point_id: "failed"}
    rows = R.read_rows(out / "results.csv", dedupe=False)
    assert len(rows) == 1 and rows.at[0, "timestamp"] >= row["timestamp"]


# ----------------------------------------------------------------------------------- errors
def test_unknown_executor_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["sweep", str(REPO / "experiments/sweeps/quick.yaml"), "--executor", "kubernetes"])
    assert e.value.code == 2
    assert "invalid choice: 'kubernetes'" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["not an address", "10.0.0.1", "http://head:6379", "head:99999"])
def test_a_bad_ray_address_is_named(address, capsys):
    with pytest.raises(ExecutorError, match="--address"):
        check_address(address)
    rc = cli_main(["sweep", str(REPO / "experiments/sweeps/quick.yaml"), "--executor", "ray",
                   "--address", address, "--no-progress"])
    assert rc == 2 and repr(address) in capsys.readouterr().err


@pytest.mark.parametrize("address", [None, "auto", "local", "ray://head", "ray://10.0.0.1:10001", "head-node:6379"])
def test_good_ray_addresses_pass(address):
    check_address(address)


@pytest.mark.parametrize("name,module", [("ray", "ray"), ("slurm", "submitit")])
def test_a_missing_package_says_what_to_install(name, module, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ExecutorError, match=r"pip install 'megatrain\[cluster\]'"):
        make_executor(name)
    assert cli_main(["sweep", str(REPO / "experiments/sweeps/quick.yaml"), "--executor", name]) == 2
    assert "megatrain[cluster]" in capsys.readouterr().err


def test_slurm_without_slurm_says_so(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda _: None)
    with pytest.raises(ExecutorError, match="sbatch"):
        make_executor("slurm", partition="gpu")


def test_the_slurm_time_limit_leaves_the_point_its_own_timeout():
    for pt in QUICK.points[:1]:
        for timeout in (0.5, 59.0, 600.0, 3601.0):
            limit = time_limit_min(type(pt)(**{**pt.to_dict(), "timeout_s": timeout}))
            assert isinstance(limit, int) and limit * 60 > timeout
