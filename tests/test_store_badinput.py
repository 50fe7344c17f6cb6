"""Bad input to the store: clear errors, faithful storage, nothing stored before is lost."""

from __future__ import annotations

import hashlib
import json
import logging

import duckdb
import pytest

from lld_monitor.store import (
    NewerSchemaError,
    NotAStoreError,
    RunNotFoundError,
    RunWriter,
    StoreError,
    open_store_reader,
)

ODD_NAME = "x'); DROP TABLE steps; -- \"quoted\" ünïcödé 🚀; semi;colons"


def _snapshot(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_run(store, name="first", steps=5) -> str:
    w = RunWriter.create(store, name, "vanilla", config={"q": "it's; \"x\""})
    w.append("steps", {"step": list(range(steps)), "reward_mean": [0.5] * steps})
    w.finish()
    return w.run_id


def test_plain_file_is_not_a_store(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    with pytest.raises(NotAStoreError, match="is a file"):
        open_store_reader(f)
    with pytest.raises(NotAStoreError, match="is a file"):
        RunWriter.create(f, "x", "vanilla")
    assert f.read_text() == "hello"


def test_duckdb_file_is_not_a_store(tmp_path):
    db = tmp_path / "runs.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE t AS SELECT 1 AS x")
    con.close()
    before = db.read_bytes()
    with pytest.raises(NotAStoreError, match="not an lld-monitor store"):
        open_store_reader(db)
    assert db.read_bytes() == before


def test_foreign_folder_and_corrupt_store_json(tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    for fn in (lambda: open_store_reader(foreign), lambda: RunWriter.create(foreign, "x", "vanilla")):
        with pytest.raises(NotAStoreError, match="not an lld-monitor store"):
            fn()
    assert sorted(p.name for p in foreign.iterdir()) == ["cat.jpg"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "store.json").write_text("{not json")
    with pytest.raises(NotAStoreError, match="corrupt"):
        open_store_reader(bad)
    (bad / "store.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(NotAStoreError, match="format"):
        open_store_reader(bad)
    with pytest.raises(NotAStoreError, match="does not exist"):
        open_store_reader(tmp_path / "missing")


def test_empty_folder_is_an_empty_store(tmp_path):
    r = open_store_reader(tmp_path)
    assert r.runs().empty and list(r.runs().columns)[:2] == ["run_id", "name"]
    assert r.sql("SELECT count(*) AS n FROM tokens")["n"][0] == 0


def test_newer_schema_version_is_refused_and_untouched(tmp_path):
    store = tmp_path / "s"
    rid = _one_run(store)
    meta = json.loads((store / "store.json").read_text())
    (store / "store.json").write_text(json.dumps({**meta, "schema_version": 99}))
    before = _snapshot(store)
    with pytest.raises(NewerSchemaError, match="schema_version 99.*Upgrade lld-monitor"):
        open_store_reader(store)
    with pytest.raises(NewerSchemaError):
        RunWriter.create(store, "second", "vanilla")
    assert _snapshot(store) == before
    (store / "store.json").write_text(json.dumps(meta))
    assert open_store_reader(store).steps(rid)["step"].tolist() == list(range(5))


def test_odd_run_name_round_trips_and_bad_run_id_is_refused(tmp_path):
    store = tmp_path / "s"
    first = _one_run(store)
    rid = _one_run(store, name=ODD_NAME)
    r = open_store_reader(store)
    assert r.run(ODD_NAME)["run_id"] == rid
    assert r.run(rid)["name"] == ODD_NAME
    assert json.loads(r.run(rid)["config"]) == {"q": "it's; \"x\""}
    assert r.sql("SELECT name FROM runs WHERE name = ?", [ODD_NAME])["name"].tolist() == [ODD_NAME]
    assert all(c.isalnum() or c in "-._" for c in rid)
    with pytest.raises(StoreError, match="not filesystem-safe"):
        RunWriter.create(store, "x", "vanilla", run_id="a'; rm -rf /")
    with pytest.raises(StoreError, match="not filesystem-safe"):
        RunWriter.create(store, "x", "vanilla", run_id="../escape")
    with pytest.raises(RunNotFoundError, match="no run"):
        r.run("nope")
    with pytest.raises(RunNotFoundError):
        r.steps("../../etc")
    assert r.steps(first)["step"].tolist() == list(range(5))


def test_existing_run_id_needs_overwrite(tmp_path):
    store = tmp_path / "s"
    w = RunWriter.create(store, "a", "vanilla", run_id="fixed-id")
    w.append("steps", {"step": [0, 1, 2]})
    w.finish()
    before = _snapshot(store / "runs" / "fixed-id")
    with pytest.raises(StoreError, match="already exists"):
        RunWriter.create(store, "b", "vanilla", run_id="fixed-id")
    assert _snapshot(store / "runs" / "fixed-id") == before
    w2 = RunWriter.create(store, "b", "llds", run_id="fixed-id", overwrite=True)
    w2.append("steps", {"step": [0]})
    w2.finish()
    r = open_store_reader(store)
    assert r.run("fixed-id")["name"] == "b" and r.run("fixed-id")["steps"] == 1
    assert not list((store / "runs").glob(".trash-*")), "the replaced run is removed once the new one finished"


def test_nan_inf_stored_faithfully_by_writer(tmp_path):
    store = tmp_path / "s"
    w = RunWriter.create(store, "nan", "vanilla")
    vals = [float("nan"), float("inf"), float("-inf"), 1.0, None]
    w.append("metrics", {"step": list(range(5)), "key": ["k"] * 5, "value": vals})
    w.finish()
    q = open_store_reader(store).sql(
        "SELECT step, value, isnan(value) AS is_nan, value IS NULL AS is_null FROM metrics ORDER BY step")
    assert q["is_nan"].tolist()[:4] == [True, False, False, False]
    assert q["is_null"].tolist() == [False, False, False, False, True]
    assert q["value"].tolist()[1:3] == [float("inf"), float("-inf")]


def test_corrupt_run_metadata_hides_only_that_run(tmp_path, caplog):
    store = tmp_path / "s"
    good = _one_run(store, "good")
    bad = _one_run(store, "bad")
    (store / "runs" / bad / "run.json").write_text("{truncated")
    with caplog.at_level(logging.WARNING):
        runs = open_store_reader(store).runs()
    assert runs["run_id"].tolist() == [good]
    assert "unreadable" in caplog.text


def test_damaged_segment_gives_a_clear_error(tmp_path):
    store = tmp_path / "s"
    rid = _one_run(store)
    seg = next((store / "runs" / rid / "steps").glob("*.parquet"))
    seg.write_bytes(seg.read_bytes()[:20])
    r = open_store_reader(store, retries=2, retry_sleep_s=0.01)
    with pytest.raises(StoreError, match="could not read the store"):
        r.steps(rid)


def test_rank_above_zero_cannot_write_steps(tmp_path):
    with pytest.raises(StoreError, match="must pass the run_id"):
        RunWriter.create(tmp_path / "s", "r", "vanilla", rank=1, world_size=2)
    w = RunWriter.create(tmp_path / "s", "r", "vanilla", run_id="r1", rank=1, world_size=2)
    with pytest.raises(StoreError, match="samples and tokens only"):
        w.append("steps", {"step": [0]})
    w.finish()
    with pytest.raises(StoreError, match="mode"):
        RunWriter.create(tmp_path / "s", "r", "fast")


def test_lost_store_json_says_how_to_recover(tmp_path):
    store = tmp_path / "s"
    rid = _one_run(store)
    (store / "store.json").unlink()
    before = _snapshot(store)
    with pytest.raises(NotAStoreError, match="recreate"):
        open_store_reader(store)
    with pytest.raises(NotAStoreError, match="recreate"):
        RunWriter.create(store, "x", "vanilla")
    assert _snapshot(store) == before
    (store / "store.json").write_text(json.dumps({"format": "lld-monitor-store", "schema_version": 1}))
    assert open_store_reader(store).run(rid)["steps"] == 5


def test_a_store_appearing_during_the_scan_is_not_a_foreign_folder(tmp_path, monkeypatch):
    """Two trainers starting at once into a new store (make_sample_runs, the demo): the second looked for store.json,
    then listed the folder after the first had created it, and refused the folder as foreign (seen 2026-12-03)."""
    from pathlib import Path

    from lld_monitor.store import layout, storedir

    store = tmp_path / "new"
    store.mkdir()
    real_iterdir = Path.iterdir

    def iterdir_after_the_other_process_won(self):
        if self == store and not (store / layout.STORE_FILE).exists():
            layout.create_json_exclusive(store / layout.STORE_FILE,
                                         {"format": layout.STORE_FORMAT, "schema_version": storedir.SCHEMA_VERSION})
            (store / layout.RUNS_DIR).mkdir()
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir_after_the_other_process_won)
    assert storedir.inspect_store(store) == (store, storedir.SCHEMA_VERSION)
    monkeypatch.undo()
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(NotAStoreError, match="not an lld-monitor store"):
        storedir.inspect_store(foreign)

