"""Schema versions: a v0 store reads without being written to, and is migrated when a writer opens it;
a segment written before a column existed reads that column as NULL (column-add migration)."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq

from lld_monitor.store import RunWriter, open_store_reader, schema
from lld_monitor.store.migrations import upgrade_run_record


def _snapshot(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _make_v0_store(root) -> None:
    """A store as the pre-release (v0) code wrote it: no schema_version anywhere, fewer run fields,
    and samples segments without the later columns delta_mean / n_actions_displaced."""
    run = root / "runs" / "old-run"
    (run / "samples").mkdir(parents=True)
    (run / "steps").mkdir()
    (root / "store.json").write_text(json.dumps({"format": "lld-monitor-store"}))
    (run / "run.json").write_text(json.dumps({
        "run_id": "old-run", "name": "old run", "mode": "vanilla", "status": "finished", "config": {"lr": 0.1},
        "model": "tiny", "started_at": "2026-11-01T10:00:00+00:00", "ended_at": "2026-11-01T11:00:00+00:00"}))
    old_samples = pa.table({"run_id": ["old-run"] * 3, "step": pa.array([0, 0, 1], pa.int64()),
                            "rank": pa.array([0, 0, 0], pa.int32()), "sample_idx": pa.array([0, 1, 0], pa.int32()),
                            "group_id": ["g", "g", "h"], "reward": [1.0, 0.0, 1.0], "advantage": [1.0, -1.0, 0.0],
                            "delta_sum": [-1.0, 0.5, -2.0]})
    pq.write_table(old_samples, run / "samples" / "r0-000000001-L0.parquet")
    pq.write_table(pa.table({"run_id": ["old-run"] * 2, "step": pa.array([0, 1], pa.int64()),
                             "reward_mean": [0.5, 1.0]}), run / "steps" / "r0-000000002-L0.parquet")
    (run / "manifest-r0.json").write_text(json.dumps({
        "run_id": "old-run", "rank": 0, "status": "finished", "heartbeat": "2026-11-01T11:00:00+00:00",
        "segments": {"samples": [{"file": "r0-000000001-L0.parquet", "level": 0, "rows": 3}],
                     "steps": [{"file": "r0-000000002-L0.parquet", "level": 0, "rows": 2}]}}))


def test_reader_reads_v0_without_writing(tmp_path):
    _make_v0_store(tmp_path)
    before = _snapshot(tmp_path)
    r = open_store_reader(tmp_path)
    assert r.schema_version == 0
    row = r.run("old run")
    assert (row["source"], row["world_size"], row["schema_version"], row["status"]) == ("local", 1, schema.SCHEMA_VERSION,
                                                                                       "finished")
    assert row["steps"] == 2 and row["last_step"] == 1
    smp = r.samples("old-run")
    assert list(smp.columns)[: len(schema.SAMPLES.names)] == list(schema.SAMPLES.names)
    assert smp["delta_sum"].tolist() == [-1.0, 0.5, -2.0]
    assert smp["delta_mean"].isna().all() and smp["n_actions_displaced"].isna().all()
    steps = r.steps("old-run")
    assert steps["reward_mean"].tolist() == [0.5, 1.0] and steps["grad_norm"].isna().all()
    assert _snapshot(tmp_path) == before, "a reader never writes"


def test_writer_migrates_v0_and_keeps_old_data(tmp_path):
    _make_v0_store(tmp_path)
    w = RunWriter.create(tmp_path, "new run", "llds")
    w.append("samples", {"step": [0], "reward": [1.0], "advantage": [0.0], "group_id": ["a"], "delta_mean": [0.1]})
    w.finish()
    assert json.loads((tmp_path / "store.json").read_text())["schema_version"] == schema.SCHEMA_VERSION
    assert json.loads((tmp_path / "store.json.v0.bak").read_text()) == {"format": "lld-monitor-store"}
    migrated = json.loads((tmp_path / "runs" / "old-run" / "run.json").read_text())
    assert migrated["schema_version"] == schema.SCHEMA_VERSION and migrated["world_size"] == 1
    assert migrated["source"] == "local"
    assert (tmp_path / "runs" / "old-run" / "run.json.v0.bak").exists()
    r = open_store_reader(tmp_path)
    assert r.schema_version == schema.SCHEMA_VERSION
    assert set(r.runs()["name"]) == {"old run", "new run"}
    assert r.samples("old-run")["delta_sum"].tolist() == [-1.0, 0.5, -2.0]
    both = r.sql("SELECT run_id, count(*) AS n, count(delta_mean) AS dm FROM samples GROUP BY run_id ORDER BY n")
    assert both["n"].tolist() == [1, 3] and both["dm"].tolist() == [1, 0]


def test_upgrade_run_record_is_pure():
    rec = {"run_id": "a", "name": "a", "mode": "vanilla", "status": "finished", "started_at": "2026-01-01T00:00:00+00:00"}
    up = upgrade_run_record(rec, 0)
    assert "schema_version" not in rec and up["schema_version"] == schema.SCHEMA_VERSION
    assert up["updated_at"] == rec["started_at"]
    assert upgrade_run_record(up, schema.SCHEMA_VERSION) == up


def test_v1_store_reads_with_no_detector_state_and_migrates_to_v2(tmp_path):
    """v2 only adds the detector_state table: a v1 store (e.g. sample_runs/ before it is regenerated) reads as is,
    its runs have no checkpoints, and a writer bumps it to v2 keeping backups."""
    w = RunWriter.create(tmp_path, "v1 run", "vanilla")
    w.append("steps", {"step": [0, 1], "reward_mean": [0.1, 0.2]})
    w.finish()
    run_json = tmp_path / "runs" / w.run_id / "run.json"
    (tmp_path / "store.json").write_text(json.dumps({"format": "lld-monitor-store", "schema_version": 1}))
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "schema_version": 1}))
    before = _snapshot(tmp_path)
    r = open_store_reader(tmp_path)
    assert r.schema_version == 1 and r.detector_state(w.run_id).empty
    assert r.steps(w.run_id)["reward_mean"].tolist() == [0.1, 0.2]
    assert _snapshot(tmp_path) == before, "a reader never writes"
    RunWriter.create(tmp_path, "v2 run", "llds").finish()
    assert json.loads((tmp_path / "store.json").read_text())["schema_version"] == 2 == schema.SCHEMA_VERSION
    assert json.loads(run_json.read_text())["schema_version"] == 2
    assert json.loads((run_json.parent / "run.json.v1.bak").read_text())["schema_version"] == 1
    assert open_store_reader(tmp_path).steps(w.run_id)["reward_mean"].tolist() == [0.1, 0.2]
