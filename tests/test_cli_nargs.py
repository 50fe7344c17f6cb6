"""Several paths / runs after one flag (`--offline a b c`, `--run A B`), as a shell glob produces them;
the repeated form (`--offline a --offline b`) keeps working."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lld_monitor.cli import build_parser, main  # noqa: E402


@pytest.mark.parametrize("argv, want", [
    (["--offline", "a", "b", "c"], ["a", "b", "c"]),
    (["--offline", "a", "--offline", "b"], ["a", "b"]),
    (["--offline", "a", "b", "--offline", "c", "--json"], ["a", "b", "c"]),
])
def test_import_wandb_offline_takes_several_paths(argv, want):
    args = build_parser("import-wandb").parse_args(["import-wandb", *argv])
    assert args.offline == want


def test_import_wandb_runs_every_offline_path(monkeypatch, tmp_path):
    import lld_monitor.integrations.wandb.importer as wi

    seen = []
    monkeypatch.setattr(wi, "import_offline", lambda store, path, **kw: seen.append(path) or [])
    rc = main(["import-wandb", "--store", str(tmp_path / "s"), "--offline", "x/offline-run-1", "x/offline-run-2",
               "--offline", "x/offline-run-3"])
    assert rc == 0 and seen == ["x/offline-run-1", "x/offline-run-2", "x/offline-run-3"]


def test_import_wandb_online_run_ids_after_one_flag():
    args = build_parser("import-wandb").parse_args(["import-wandb", "--entity", "e", "--project", "p", "--run", "r1", "r2"])
    assert args.run == ["r1", "r2"]


@pytest.fixture(scope="module")
def pair_store(tmp_path_factory):
    from bench.synth_store import write_pair

    store = tmp_path_factory.mktemp("nargs") / "store"
    write_pair(store, steps=30, token_every=0, flush_every=30)
    return store


@pytest.mark.parametrize("form", ["one_flag", "repeated"])
def test_detect_takes_several_runs(pair_store, capsys, form):
    names = ["synth-vanilla", "synth-llds"]
    runs = ["--run", *names] if form == "one_flag" else ["--run", names[0], "--run", names[1]]
    assert main(["detect", "--store", str(pair_store), *runs, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in out["runs"]] == names
