"""Compaction as the run goes keeps the file count bounded, and a reader racing it (merged-away
segments deleted at once: retire_grace_s=0) still sees exact prefixes and no error."""

from __future__ import annotations

import threading

import numpy as np

from lld_monitor.store import RunWriter, WriterConfig, open_store_reader


def test_file_count_stays_small_during_the_run(tmp_path):
    cfg = WriterConfig(compact_fanout=4, retire_grace_s=0.0, max_segments_per_table=12)
    w = RunWriter.create(tmp_path, "c", "vanilla", writer_config=cfg)
    most = 0
    for s in range(200):
        w.append("steps", {"step": [s]})
        w.append("samples", {"step": [s] * 3, "sample_idx": [0, 1, 2], "reward": [1.0] * 3, "advantage": [0.0] * 3,
                             "group_id": ["g"] * 3})
        w.flush()
        most = max(most, len(w._manifest["segments"]["samples"]))
    # the background compactor may lag a writer flushing back to back, but never past the bound
    assert most <= cfg.max_segments_per_table + 1
    r = open_store_reader(tmp_path)
    assert r.steps(w.run_id)["step"].tolist() == list(range(200))
    assert len(r.samples(w.run_id)) == 600
    w.finish()
    assert len(list((w.path / "samples").glob("*.parquet"))) == 1
    assert len(r.samples(w.run_id)) == 600


def test_reader_racing_compaction_sees_prefixes_without_errors(tmp_path):
    w = RunWriter.create(tmp_path, "race", "vanilla", writer_config=WriterConfig(compact_fanout=2, retire_grace_s=0.0))
    w.flush()
    r = open_store_reader(tmp_path, retries=50, retry_sleep_s=0.005)
    stop = threading.Event()
    seen: list[tuple[int, int, int]] = []
    errors: list[str] = []

    def read() -> None:
        while not stop.is_set():
            try:
                q = r.sql("SELECT (SELECT count(*) FROM steps), (SELECT coalesce(max(step), -1) FROM steps), "
                          "(SELECT count(*) FROM samples)")
                seen.append(tuple(int(x) for x in q.iloc[0]))
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    t = threading.Thread(target=read)
    t.start()
    for s in range(150):
        w.append("steps", {"step": [s]})
        w.append("samples", {"step": np.full(4, s), "sample_idx": np.arange(4), "reward": np.ones(4),
                             "advantage": np.zeros(4), "group_id": ["g"] * 4})
        w.flush()
    w.finish()
    stop.set()
    t.join(timeout=30)
    assert errors == []
    assert len(seen) > 5
    for n, last, smp in seen:
        assert last == n - 1 and smp == 4 * n
    assert [n for n, _, _ in seen] == sorted(n for n, _, _ in seen)
