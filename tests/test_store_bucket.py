"""A store in a bucket (issue 38), against a real S3 server: SeaweedFS on loopback (tests/conftest.py `s3_server`).

What the writer promises (create-only segments and store.json, a manifest replaced only on its ETag, a second writer
refused, overwrite without rename), what the reader's mirror promises (only changed objects fetched, finished runs
not listed again, unlisted segments dropped, bounded disk), and the errors a user gets for a bad set-up.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from lld_monitor.store import RunWriter, StoreError, open_store_reader
from lld_monitor.store.bucket import Bucket, ObjectExists
from lld_monitor.store.compare import run_differences
from lld_monitor.store.errors import NotAStoreError, WriterConflictError
from lld_monitor.store.writer import WriterConfig


def _write(store, run_id: str, steps: int = 30, cfg: WriterConfig | None = None, finish: bool = True):
    w = RunWriter.create(store, f"run {run_id}", "vanilla", run_id=run_id, writer_config=cfg)
    rng = np.random.default_rng(0)
    for i in range(steps):
        w.append("steps", {"step": [i], "reward_mean": [float(rng.normal())], "time": [0]})
        w.append("metrics", {"step": [i, i], "key": ["a", "b"], "value": [float(i), float("nan")]})
        w.append("samples", {"step": [i] * 4, "sample_idx": np.arange(4), "reward": rng.normal(size=4),
                             "advantage": rng.normal(size=4), "group_id": [0, 0, 1, 1], "text": ["x'y", "é", "", "z"]})
        if i % 3 == 0:
            w.append("tokens", {"step": [i] * 5, "sample_idx": [0] * 5, "position": np.arange(5),
                                "token_id": np.arange(5), "logp_old": rng.normal(size=5)})
        w.flush()
    if finish:
        w.finish()
    return w


def test_a_run_in_a_bucket_reads_back_as_the_same_run_in_a_folder(s3_store, tmp_path):
    cfg = WriterConfig(compact_fanout=4, retire_grace_s=0.0)
    _write(tmp_path / "folder", "same", cfg=cfg)
    w = _write(s3_store, "same", cfg=cfg)
    assert w.uploads > 0
    local, remote = open_store_reader(tmp_path / "folder"), open_store_reader(s3_store, poll_s=0)
    assert run_differences(local, "same", remote, "same") == []
    a, b = local.runs().drop(columns=["started_at", "ended_at", "updated_at"]), remote.runs()
    assert b.status[0] == "finished" and int(b.steps[0]) == 30
    assert a.drop(columns=["config"]).equals(b.drop(columns=["started_at", "ended_at", "updated_at", "config"]))
    assert remote.sql("SELECT count(*) AS n FROM tokens WHERE run_id = ?", ["same"]).n[0] == 50
    # finished and compacted: one object per table, nothing else left in the bucket
    keys = sorted(o.key for o in Bucket(s3_store).list_all("runs/same"))
    assert [k.split("/")[2] for k in keys if k.endswith(".parquet")] == ["metrics", "samples", "steps", "tokens"]


def test_a_second_writer_for_the_same_run_and_rank_is_refused(s3_store):
    first = _write(s3_store, "r", steps=2, finish=False)
    with pytest.raises(StoreError, match="already exists.*nothing was changed"):
        RunWriter.create(s3_store, "again", "vanilla", run_id="r")
    # a restarted trainer told to take over (overwrite=True): the first one is refused at its next write
    second = RunWriter.create(s3_store, "takeover", "vanilla", run_id="r", overwrite=True)
    first.append("steps", {"step": [2]})
    with pytest.raises(WriterConflictError, match="replaced by another writer"):
        first.flush()
    second.append("steps", {"step": [0]})
    second.finish()
    r = open_store_reader(s3_store, poll_s=0)
    assert r.run("r")["name"] == "takeover" and r.steps("r").step.tolist() == [0]
    # the old run's segments are gone from the bucket once the new one finished
    keys = [o.key for o in Bucket(s3_store).list_all("runs/r")]
    assert len([k for k in keys if k.endswith(".parquet")]) == 1, keys


def test_a_failed_overwrite_puts_the_previous_run_back(s3_store):
    _write(s3_store, "imp", steps=3)
    w = RunWriter.create(s3_store, "reimport", "vanilla", run_id="imp", overwrite=True)
    w.append("steps", {"step": [0]})
    w.finish("crashed")
    assert w.restore_previous()
    r = open_store_reader(s3_store, poll_s=0)
    assert r.run("imp")["name"] == "run imp" and r.run("imp")["status"] == "finished"
    assert r.steps("imp").step.tolist() == [0, 1, 2]


def test_store_json_is_create_only_and_a_foreign_prefix_is_refused(s3_store):
    _write(s3_store, "a", steps=1)
    b = Bucket(s3_store)
    with pytest.raises(ObjectExists):
        b.put("store.json", b"{}", create=True)
    foreign = s3_store + "-foreign"
    Bucket(foreign).put("notes.txt", b"hello")
    for fn in (lambda: open_store_reader(foreign), lambda: RunWriter.create(foreign, "x", "vanilla")):
        with pytest.raises(NotAStoreError, match="not an lld-monitor store"):
            fn()
    assert [o.key for o in Bucket(foreign).list_all("")] == ["notes.txt"]  # nothing written


def test_two_writers_starting_a_new_prefix_at_once_both_open_it(s3_store, monkeypatch):
    """The race two torchrun ranks hit on a new prefix: between one writer's GET of store.json (404) and its LIST of
    the prefix, the other creates the store; SeaweedFS also lists the directory it is creating as a zero-byte
    object named like the prefix (a folder marker, as a console's "Create folder" makes). Neither is a foreign
    prefix."""
    import datetime as dt

    from lld_monitor.store.bucket import ObjectInfo
    from lld_monitor.store.storedir import open_bucket_store_for_write

    real_list = Bucket.list_dir
    marker = ObjectInfo(key="", size=0, etag=None, last_modified=dt.datetime.now(dt.timezone.utc))

    def list_while_another_writer_starts(self, prefix):
        monkeypatch.setattr(Bucket, "list_dir", real_list)
        open_bucket_store_for_write(Bucket(s3_store))  # the other rank got there first
        subs, objs = real_list(self, prefix)
        return subs, [marker, *objs]

    monkeypatch.setattr(Bucket, "list_dir", list_while_another_writer_starts)
    w = RunWriter.create(s3_store, "rank 0", "vanilla", run_id="ddp")
    assert Bucket.list_dir is real_list  # the race happened
    w.finish()
    assert open_store_reader(s3_store, poll_s=0).run("ddp")["status"] == "finished"
    # a folder marker alone is an empty prefix, where a store may start
    monkeypatch.setattr(Bucket, "list_dir", lambda self, prefix: ([], [marker]))
    from lld_monitor.store.storedir import inspect_bucket_store

    assert inspect_bucket_store(Bucket(s3_store + "-empty")) is None


def test_a_server_without_conditional_writes_is_refused(s3_store, monkeypatch):
    import lld_monitor.store.bucket as bucket_mod

    real_put = Bucket.put
    monkeypatch.setattr(bucket_mod, "_CHECKED", set())
    monkeypatch.setattr(Bucket, "put", lambda self, key, data, create=False, if_match=None: real_put(self, key, data))
    with pytest.raises(StoreError, match="does not honour conditional writes"):
        RunWriter.create(s3_store, "x", "vanilla")


@pytest.mark.parametrize("what", ["wrong key", "no key", "no bucket", "plain http"])
def test_a_bad_setup_is_a_clear_error_at_start(s3_store, monkeypatch, what):
    url = s3_store
    if what == "wrong key":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        expect = "refused the credentials.*AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    elif what == "no key":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        expect = "no credentials.*set AWS_ACCESS_KEY_ID"
    elif what == "no bucket":
        url = "s3://no-such-bucket/p"
        expect = "bucket 'no-such-bucket' .* does not exist"
    else:
        monkeypatch.delenv("AWS_ALLOW_HTTP")
        expect = "plain http: set AWS_ALLOW_HTTP=true"
    for fn in (lambda: RunWriter.create(url, "x", "vanilla"), lambda: open_store_reader(url)):
        with pytest.raises(StoreError, match=expect):
            fn()


def test_the_mirror_fetches_only_what_changed(s3_store, tmp_path):
    cfg = WriterConfig(compact_fanout=4, retire_grace_s=0.0, background_compaction=False)
    done = _write(s3_store, "done", steps=5, cfg=cfg)
    live = _write(s3_store, "live", steps=3, cfg=cfg, finish=False)
    r = open_store_reader(s3_store, poll_s=0, mirror_dir=tmp_path / "m")
    m = r._mirror
    assert set(r.runs().run_id) == {"done", "live"}
    r.samples("live")
    before, fetched = m.bucket.requests, m.fetched_bytes
    r.runs()  # nothing new: 1 LIST of runs/ + 1 LIST of the live run (+ the server's clock now and then)
    assert m.bucket.requests - before <= 3 and m.fetched_bytes == fetched
    # new segments of the live run: its changed manifest and the segments of the tables in use come over
    for i in range(3, 12):
        live.append("steps", {"step": [i]})
        live.append("samples", {"step": [i], "sample_idx": [0], "reward": [1.0], "advantage": [0.0], "group_id": [0]})
        live.flush()
    assert r.steps("live").step.tolist() == list(range(12))
    assert len(r.samples("live")) == 12 + 3 * 3
    # merged-away segments left the mirror: exactly the listed files are on disk
    man = json.loads((m.root / "runs/live/manifest-r0.json").read_text())
    for t in ("steps", "samples"):
        on_disk = sorted(p.name for p in (m.root / "runs/live" / t).glob("*.parquet"))
        assert on_disk == sorted(s["file"] for s in man["segments"][t]), t
    # a finished run is not listed again on every poll
    assert m._runs["done"].finished
    checked = m._runs["done"].checked
    r.runs()
    assert m._runs["done"].checked == checked
    live.finish()
    assert r.run("live")["status"] == "finished"
    assert done.finished


def test_the_first_look_lists_once_and_fetches_a_runs_small_tables_in_one_round(s3_store, tmp_path, monkeypatch):
    for rid in ("a", "b"):
        w = _write(s3_store, rid, steps=4, finish=False)
        w.append("alerts", {"step": [3], "phase": ["healthy"], "severity": ["info"], "signal": ["x"], "value": [0.0],
                            "threshold": [0.0], "message": ["x"]})
        w.finish()
    r = open_store_reader(s3_store, poll_s=60, mirror_dir=tmp_path / "m")  # the LIST made at open is fresh enough
    calls: list[tuple[str, str]] = []
    for name in ("list_dir", "list_all", "get"):
        real = getattr(r._mirror.bucket, name)
        monkeypatch.setattr(r._mirror.bucket, name, lambda key, real=real, name=name: calls.append((name, key))
                            or real(key))

    def tables(kind: str) -> list[str]:
        return sorted(k.split("/")[2] for n, k in calls if n == kind and k.endswith(".parquet"))

    assert set(r.runs().run_id) == {"a", "b"}
    assert [c for c in calls if c[0] != "get"] == []  # the first sync uses the LIST of runs/ made beside store.json
    assert tables("get") == ["steps", "steps"]  # the run list counts steps: nothing else yet
    calls.clear()
    r._mirror.poll_s = 0
    assert len(r.metrics("a")) == 8  # brings a's alerts with it (no detector_state here), not its samples or tokens
    assert sorted(k.rsplit("/", 2)[-2] for n, k in calls if n == "get") == ["alerts", "metrics"]
    assert all(k.startswith("runs/a/") for _, k in calls if k.endswith(".parquet"))
    calls.clear()
    assert len(r.alerts("a")) == 1 and len(r.steps("a")) == 4 and r.detector_state("a").empty
    assert tables("get") == []
    assert len(r.samples("a")) == 16
    assert tables("get") == ["samples"]
    # a detector cache put there later comes over at a sync; gone from the bucket, it leaves the mirror
    r._mirror.recheck_s = 0
    cache = "runs/b/detector_cache/x.parquet"
    Bucket(s3_store).put(cache, b"not read here")
    r.runs()
    assert (r._mirror.root / cache).read_bytes() == b"not read here"
    Bucket(s3_store).delete(cache)
    r.runs()
    assert not (r._mirror.root / cache).exists()


def test_the_mirror_stays_within_its_disk_bound(s3_store, tmp_path):
    for rid in ("a", "b", "c"):
        _write(s3_store, rid, steps=4)
    r = open_store_reader(s3_store, poll_s=0, mirror_dir=tmp_path / "m")
    m = r._mirror
    r.runs()  # the steps segments of every run (the run list counts steps)
    for rid in ("a", "b", "c"):
        r.samples(rid)
    m.max_bytes = m.disk_bytes  # full: reading more drops the least recently read (run, table) first
    assert len(r.tokens("c", 0)) == 5
    assert m.disk_bytes <= m.max_bytes
    assert not list((m.root / "runs/a/steps").glob("*.parquet"))  # read first, dropped first
    assert list((m.root / "runs/c/tokens").glob("*.parquet"))
    assert r.steps("a").step.tolist() == [0, 1, 2, 3]  # fetched again when read
    assert m.disk_bytes <= m.max_bytes
