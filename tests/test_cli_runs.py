"""`lld-monitor runs [--json]`: the public JSON shape, the table, errors, the --store default."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lld_monitor.cli import main
from lld_monitor.store import RunWriter

FIELDS = {"run_id", "name", "mode", "source", "status", "steps", "last_step", "started_at", "ended_at",
          "updated_at", "model", "world_size", "schema_version"}


def _store(path):
    a = RunWriter.create(path, "vanilla 'a'; ü", "vanilla", model="tiny")
    a.append("steps", {"step": [0, 1, 2, 5]})
    a.finish()
    b = RunWriter.create(path, "llds b", "llds", source="trl")
    b.append("steps", {"step": [0]})
    b.flush()  # left running (this process is alive)
    return a, b


def test_runs_json_shape(tmp_path, capsys):
    a, b = _store(tmp_path)
    assert main(["runs", "--store", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["runs"]
    by_name = {r["name"]: r for r in doc["runs"]}
    assert set(by_name) == {"vanilla 'a'; ü", "llds b"}
    for r in doc["runs"]:
        assert FIELDS <= set(r)
        assert r["status"] in ("running", "finished", "crashed")
    ra, rb = by_name["vanilla 'a'; ü"], by_name["llds b"]
    assert (ra["mode"], ra["source"], ra["status"], ra["steps"], ra["last_step"], ra["model"]) == (
        "vanilla", "local", "finished", 4, 5, "tiny")
    assert (rb["mode"], rb["source"], rb["status"], rb["steps"], rb["ended_at"]) == ("llds", "trl", "running", 1, None)
    assert ra["updated_at"].endswith("+00:00") and isinstance(ra["world_size"], int)
    b.finish()


def test_runs_table_and_errors(tmp_path, capsys):
    _store(tmp_path / "s")
    assert main(["runs", "--store", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "llds b" in out and "finished" in out and out.splitlines()[0].split()[:4] == ["name", "mode", "source", "status"]
    (tmp_path / "f.txt").write_text("x")
    assert main(["runs", "--store", str(tmp_path / "f.txt"), "--json"]) == 2
    assert "is a file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["runs", "--store", str(tmp_path / "empty"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"runs": []}


def test_store_default_from_env_and_help(tmp_path):
    _store(tmp_path)
    env = {**os.environ, "LLD_MONITOR_STORE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "lld_monitor.cli", "runs", "--json"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert len(json.loads(out)["runs"]) == 2
    help_ = subprocess.run([sys.executable, "-m", "lld_monitor.cli", "runs", "--help"], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    assert "--store PATH" in help_ and "LLD_MONITOR_STORE" in help_
