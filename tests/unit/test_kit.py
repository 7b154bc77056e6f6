"""The test kit's worker launcher: the environment a test's process gets, and a failed process failing its test
with what it said."""

from __future__ import annotations

import os
import sys

import pytest
from kit import ROOT, finish, probes, run_python, start_python, worker_env


def test_a_lone_process_gets_no_launcher_variable_and_imports_this_checkout(monkeypatch):
    monkeypatch.setenv("RANK", "3")  # as a leaked variable or a launcher-started pytest would leave it
    monkeypatch.setenv("WORLD_SIZE", "4")
    env = worker_env(threads=1, path=["/nowhere"])
    assert "RANK" not in env and "WORLD_SIZE" not in env and env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == ["/nowhere", str(ROOT)]
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    code = "import os, megatrain; print(os.path.dirname(os.path.dirname(megatrain.__file__)), os.environ.get('RANK'))"
    r = run_python(["-c", code], env=env, cwd="/", timeout=120, check=True)
    assert r.stdout.split() == [str(ROOT), "None"]


def test_a_world_size_gives_each_rank_its_variables_on_a_free_port():
    a, b = worker_env(world_size=2, rank=1, local_rank=0), worker_env(world_size=2)
    assert (a["RANK"], a["LOCAL_RANK"], a["WORLD_SIZE"], a["MASTER_ADDR"]) == ("1", "0", "2", "127.0.0.1")
    assert (b["RANK"], b["LOCAL_RANK"]) == ("0", "0") and 0 < int(a["MASTER_PORT"]) < 65536
    assert worker_env(world_size=2, port=29999)["MASTER_PORT"] == "29999"


def test_a_failed_process_fails_the_test_with_its_output(tmp_path):
    code = "import sys; print('said on stdout'); sys.exit('said on stderr')"
    with pytest.raises(pytest.fail.Exception, match="(?s)exited with 1.*said on stdout.*said on stderr"):
        run_python(["-c", code], timeout=60, check=True)
    assert run_python(["-c", code], timeout=60).returncode == 1  # control: without check the caller decides
    log = tmp_path / "run.log"
    proc = start_python(["-c", code], log=log)
    # one log for both streams: their order there is the child's buffering (stdout to a file flushes at exit)
    with pytest.raises(pytest.fail.Exception, match="(?s)exited with 1(?=.*said on stdout)(?=.*said on stderr)"):
        finish(proc, timeout=60, log=log)
    finish(start_python(["-c", "print('fine')"], log=log), timeout=60, log=log)  # control: exit 0 passes
    assert log.read_text() == "fine\n"


def test_probes_are_read_where_they_start_even_two_on_a_line():
    out = 'noise\nPROBE {"rank": 0}PROBE {"rank": 1}\nPROBE {"rank": 2, "s": "PROBE x"}\n'
    assert probes(out) == [{"rank": 0}, {"rank": 1}, {"rank": 2, "s": "PROBE x"}]
