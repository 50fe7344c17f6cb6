"""The trainer side of a store in a bucket (`s3://bucket/prefix`): RunWriter with no rename anywhere.

`BucketWriting` holds RunWriter's file operations done on a bucket; `writer.BucketRunWriter` is the two together
(`RunWriter.create("s3://...")` makes one), so this module needs nothing from writer.py.

The layout is the folder's (docs/store.md), as object keys under the prefix. What changes:

- **Segments** are written once, under keys that name their writer and sequence (`<table>/r<R>-<seq>-L<level>.parquet`),
  by a create-only PUT (`If-None-Match: *`). Each is first written to a local spool file, which merges read, so
  compaction never downloads. A key already taken (an upload of a writer that died before listing it) is skipped
  for the next sequence number; one holding exactly our bytes (our own PUT whose answer was lost) is kept.
- **The manifest** of a rank is created with a create-only PUT and then only replaced with a PUT conditional on the
  ETag this writer last wrote (`If-Match`). A second writer for the same run and rank is refused at start (the key
  exists: "pass overwrite=True"); a writer whose manifest changed under it (someone took the run over) stops with
  `WriterConflictError` instead of interleaving. Segments are uploaded before the manifest that lists them, so a
  reader only ever sees complete segments and, per flush, all tables or none.
- **store.json** and a rank > 0's placeholder `run.json` are create-only; rank 0 writes `run.json`.
- **At start** the writer checks that the server honours conditional writes (`Bucket.check_conditional_writes`).
- **overwrite=True** (rank 0, e.g. a W&B re-import): the old run's manifests and run.json are kept in memory, this
  rank's manifest is replaced (conditional on its ETag, sequence numbers carried on so no key is reused), the other
  ranks' manifests and the run's derived caches are deleted; the old segments, no longer listed, are deleted when
  the new run finishes (`discard_previous`), or the old manifests are put back (`restore_previous`).
- **An unreachable server** mid-run: the flush keeps the new segments in the spool, logs a warning (once, then every
  30 s) and returns; the next flush uploads everything in order and publishes the manifest. Nothing is dropped and
  `log_step` never waits for it (uploads run in RunLogger's writer thread; the queue absorbs a slow flush).
  `finish()` keeps trying for `FINISH_RETRY_S`, then raises, leaving the spool folder in place.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import layout, stepset
from .bucket import Bucket, ObjectChanged, ObjectExists, md5_etag
from .convert import schema_fingerprint
from .errors import BucketUnavailable, StoreError, WriterConflictError
from .storedir import open_bucket_store_for_write

log = logging.getLogger(__name__)

FINISH_RETRY_S = 60.0  # finish() keeps trying to publish this long while the bucket is out of reach
OUTAGE_WARN_EVERY_S = 30.0
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 8.0  # while out of reach, uploads are tried again after 1, 2, 4, 8, 8, ... s
CACHE_DIRS = (layout.DETECTOR_CACHE_DIR, "derived")  # a run's derived files, not carried over by overwrite=True


def _now_iso() -> str:
    return layout.iso(layout.utcnow())  # type: ignore[return-value]


def _run_prefix(run_id: str) -> str:
    return f"{layout.RUNS_DIR}/{run_id}"


def _manifest_key(run_id: str, rank: int) -> str:
    return f"{_run_prefix(run_id)}/{layout.MANIFEST_PREFIX}{rank}.json"


class BucketWriting:
    """RunWriter's file operations on a bucket (a mixin before RunWriter: `writer.BucketRunWriter`). Create one with
    `RunWriter.create("s3://...", ...)`."""

    # what RunWriter provides (this class only ever runs mixed into it)
    _lock: Any
    _buffers: dict[str, list[pa.Table]]
    _manifest: dict[str, Any]
    _record: dict[str, Any]
    cfg: Any
    run_id: str
    rank: int
    rows_written: dict[str, int]

    def __init__(self, bucket: Bucket, run_id: str, rank: int, record: dict[str, Any], manifest: dict[str, Any],
                 cfg: Any, etag: str, previous: dict[str, Any] | None):
        super().__init__(Path(bucket.url), run_id, rank, record, manifest, cfg, None)  # type: ignore[call-arg]
        self.bucket = bucket
        self.store = bucket.url  # type: ignore[assignment]
        self._etag = etag
        self._token = manifest["writer"]["token"]
        self._previous = previous
        self._spool = Path(tempfile.mkdtemp(prefix=f"lld-upload-{run_id[:40]}-r{rank}-"))
        self._unsent: list[tuple[str, dict[str, Any]]] = []  # (table, entry) spooled, not yet uploaded
        self._record_dirty = False
        self._published = True
        self._outage_since: float | None = None
        self._outage_warned = 0.0
        self.uploads = 0
        self._seq_lock = threading.Lock()
        self._published_keys: set[str] = set()
        self._conflict: WriterConflictError | None = None
        self._next_try = 0.0
        self._backoff = RETRY_FIRST_S

    # ---------------------------------------------------------------- creation
    @classmethod
    def create_in_bucket(cls, url: str, name: str, mode: str, *, source: str, config: dict | None, model: str | None,
                         run_id: str, rank: int, world_size: int, overwrite: bool, writer_config: Any):
        bucket = Bucket(url)
        open_bucket_store_for_write(bucket)
        record, manifest = cls._new_record(run_id, name, mode, source, config, model, rank, world_size)
        manifest["writer"]["token"] = secrets.token_hex(8)
        mkey = _manifest_key(run_id, rank)
        previous = None
        try:
            etag = bucket.put(mkey, layout.dumps(manifest).encode(), create=True)
        except ObjectExists:
            if not overwrite:
                raise StoreError(
                    f"run {run_id!r} (rank {rank}) already exists in {bucket.url}; nothing was changed. Pass "
                    "overwrite=True to replace it, or use another run_id (two writers never share a run and rank)."
                ) from None
            if rank != 0:
                raise StoreError(f"overwrite=True in a bucket is rank 0's to do (it replaces the whole run {run_id!r}); "
                                 "nothing was changed") from None
            previous, old_etag, old_seq = cls._set_aside(bucket, run_id)
            manifest["seq"] = old_seq  # go on numbering: no key of the old run is written again
            try:
                etag = bucket.put(mkey, layout.dumps(manifest).encode(), if_match=old_etag)
            except ObjectChanged:
                raise StoreError(f"run {run_id!r} changed in {bucket.url} while overwrite=True replaced it (another "
                                 "writer?); try again") from None
            log.info("overwrite: run %s replaced in %s; its old segments are deleted when the new one finishes",
                     run_id, bucket.url)
        run_key = f"{_run_prefix(run_id)}/{layout.RUN_FILE}"
        if rank == 0:
            bucket.put(run_key, layout.dumps(record).encode())
        else:
            try:  # a placeholder until rank 0 writes it
                bucket.put(run_key, layout.dumps(record).encode(), create=True)
            except ObjectExists:
                pass
        w = cls(bucket, run_id, rank, record, manifest, writer_config, etag, previous)
        log.debug("writing run %s rank %d into %s", run_id, rank, bucket.url)
        return w

    @staticmethod
    def _set_aside(bucket: Bucket, run_id: str) -> tuple[dict[str, Any], str, int]:
        """What overwrite=True needs of the old run: every key, the JSON objects (to restore), the ETag and sequence of
        rank 0's manifest. Other ranks' manifests and the derived caches go now, so no reader mixes old and new."""
        objs = bucket.list_all(_run_prefix(run_id) + "/")
        saved: dict[str, bytes] = {}
        for o in objs:
            if o.key.endswith(".json") and "/" not in o.key[len(_run_prefix(run_id)) + 1:]:
                saved[o.key] = bucket.get(o.key)[0]
        mkey = _manifest_key(run_id, 0)
        data, info = bucket.get(mkey)
        try:
            old_seq = int(json.loads(data).get("seq", 0))
        except (ValueError, AttributeError):
            old_seq = 0
        for o in objs:
            rest = o.key[len(_run_prefix(run_id)) + 1:]
            other_manifest = rest.startswith(layout.MANIFEST_PREFIX) and o.key != mkey
            if other_manifest or rest.split("/", 1)[0] in CACHE_DIRS:
                bucket.delete(o.key)
        return {"keys": [o.key for o in objs], "json": saved}, info.etag or "", old_seq + 1000

    # ---------------------------------------------------------------- properties
    @property
    def path(self) -> str:  # type: ignore[override]
        return f"{self.bucket.url}/{_run_prefix(self.run_id)}"

    @property
    def spool(self) -> Path:
        """The local folder holding this writer's segments (uploaded or waiting to be)."""
        return self._spool

    def _key(self, table: str, fname: str) -> str:
        return f"{_run_prefix(self.run_id)}/{table}/{fname}"

    # ---------------------------------------------------------------- writing
    def flush(self) -> None:
        with self._lock:
            self._check_open()
            self._flush_locked()
            if self._outage_since is None:
                behind = max(len(v) for v in self._manifest["segments"].values()) > self.cfg.max_segments_per_table
                try:
                    if not self.cfg.background_compaction or behind:
                        self._compact_locked(final=False)
                    self._delete_retired_locked(force=False)
                except BucketUnavailable as e:
                    self._note_outage(e)
        if self.cfg.background_compaction and self._outage_since is None:
            self._kick_compactor()

    def _flush_locked(self) -> None:
        for t, parts in self._buffers.items():
            if not parts:
                continue
            tbl = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            fname = self._next_name(0)
            pq.write_table(tbl, self._spool_file(t, fname), compression=self.cfg.compression)
            self._unsent.append((t, {"file": fname, "level": 0, "rows": tbl.num_rows, "schema": schema_fingerprint(t),
                                     "steps": stepset.compress(stepset.of_table(tbl))}))
            self.rows_written[t] += tbl.num_rows
            self._buffers[t] = []
        self._manifest["heartbeat"] = _now_iso()
        self._write_manifest()

    def _next_name(self, level: int) -> str:
        with self._seq_lock:  # uploads run on the bucket's pool threads, which do not hold the writer's lock
            return super()._next_name(level)

    def _spool_file(self, table: str, fname: str) -> Path:
        d = self._spool / table
        d.mkdir(exist_ok=True)
        return d / fname

    def _upload(self, table: str, fname: str) -> str:
        """PUT one spooled segment, create-only. Returns the name it was stored under."""
        level = int(fname.rsplit("-L", 1)[1].split(".")[0])
        while True:
            path = self._spool_file(table, fname)
            data = path.read_bytes()
            try:
                self.bucket.put(self._key(table, fname), data, create=True)
                self.uploads += 1
                return fname
            except ObjectExists:
                if self.bucket.head(self._key(table, fname)).etag == md5_etag(data):
                    return fname  # our own PUT, whose answer was lost
                new = self._next_name(level)
                log.info("run %s: segment key %s is taken (a dead writer's unlisted upload); using %s",
                         self.run_id, fname, new)
                os.replace(path, self._spool_file(table, new))
                fname = new

    def _publish_locked(self) -> None:
        """Upload what is spooled (in parallel), then this rank's manifest (If-Match), then run.json if it changed.
        BucketUnavailable leaves everything queued for the next call."""
        if self._conflict is not None:
            raise self._conflict
        if self._unsent:
            todo = list(self._unsent)
            results: list[Any] = self.bucket.map(lambda te: self._try(self._upload, te[0], te[1]["file"]), todo)
            failed: BaseException | None = None
            keep = []
            for (t, entry), res in zip(todo, results):
                if isinstance(res, BaseException) or failed is not None:
                    failed = failed or res
                    keep.append((t, entry))
                    continue
                entry["file"] = res
                self._manifest["segments"][t].append(entry)
            self._unsent = keep
            if failed is not None:
                raise failed
        self._put_manifest()
        if self._record_dirty and self.rank == 0:
            self.bucket.put(f"{_run_prefix(self.run_id)}/{layout.RUN_FILE}", layout.dumps(self._record).encode())
            self._record_dirty = False

    @staticmethod
    def _try(fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - handed back to _publish_locked, which raises the first
            return e

    def _listed_keys(self) -> set[str]:
        return {self._key(t, s["file"]) for t, segs in self._manifest["segments"].items() for s in segs}

    def _put_manifest(self) -> None:
        body = layout.dumps(self._manifest).encode()
        key = _manifest_key(self.run_id, self.rank)
        try:
            self._etag = self.bucket.put(key, body, if_match=self._etag)
            self._published_keys = self._listed_keys()
        except ObjectChanged:
            try:
                current, info = self.bucket.get(key)
                theirs = json.loads(current).get("writer", {})
            except (FileNotFoundError, ValueError, AttributeError):
                theirs, info = {}, None
            if info is not None and theirs.get("token") == self._token:
                self._etag = info.etag  # our own earlier PUT landed but its answer was lost
                self._etag = self.bucket.put(key, body, if_match=self._etag)
                self._published_keys = self._listed_keys()
                return
            for orphan in self._listed_keys() - self._published_keys:  # uploaded for a manifest never published
                self.bucket.delete(orphan)
            self._conflict = WriterConflictError(
                f"run {self.run_id!r} rank {self.rank}: its manifest in {self.bucket.url} was replaced by another writer "
                f"(pid {theirs.get('pid')} on {theirs.get('host')}); this writer stops writing so the two do not "
                "interleave. Two trainers must not log the same run and rank: give the second its own run_id."
            )
            raise self._conflict from None

    def _write_manifest(self) -> None:
        final = self._manifest.get("status") != "running"
        if not final and self._outage_since is not None and time.monotonic() < self._next_try:
            return  # out of reach: the flush only spooled its segments; the next try comes after a backoff
        deadline = time.monotonic() + FINISH_RETRY_S
        while True:
            try:
                self._publish_locked()
                self._published = True
                self._note_back()
                return
            except BucketUnavailable as e:
                self._published = False
                self._note_outage(e)
                if not final or time.monotonic() > deadline:
                    if final:
                        raise StoreError(
                            f"run {self.run_id!r} rank {self.rank}: {self.bucket.where} stayed out of reach for "
                            f"{FINISH_RETRY_S:.0f} s at finish; {len(self._unsent)} segment(s) and the final manifest "
                            f"were not uploaded. They are kept in {self._spool}.") from e
                    return
                time.sleep(1.0)

    def _write_record(self) -> None:
        self._record_dirty = True
        if self.rank == 0 and self._outage_since is None:
            try:
                self.bucket.put(f"{_run_prefix(self.run_id)}/{layout.RUN_FILE}", layout.dumps(self._record).encode())
                self._record_dirty = False
            except BucketUnavailable as e:
                self._note_outage(e)
                if self._manifest.get("status") != "running":
                    raise

    # ---------------------------------------------------------------- segments on the spool
    def _segment_file(self, table: str, fname: str) -> Path:
        return self._spool_file(table, fname)

    def _merge_tmp(self, table: str, fname: str) -> Path:
        return self._spool_file(table, f".{fname}.tmp")

    def _publish_merged(self, table: str, fname: str, tmp: Path) -> str:
        os.replace(tmp, self._spool_file(table, fname))
        return self._upload(table, fname)

    def _drop_unpublished(self, table: str, fname: str) -> None:
        self._spool_file(table, fname).unlink(missing_ok=True)
        try:
            self.bucket.delete(self._key(table, fname))
        except StoreError as e:
            log.info("could not delete the unlisted segment %s (%s); readers never see it", fname, e)

    def _delete_segment(self, relpath: str) -> None:
        self.bucket.delete(f"{_run_prefix(self.run_id)}/{relpath}")
        (self._spool / relpath).unlink(missing_ok=True)

    # ---------------------------------------------------------------- outages
    def _note_outage(self, e: BaseException) -> None:
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
            self._backoff = RETRY_FIRST_S
        else:
            self._backoff = min(RETRY_MAX_S, self._backoff * 2)
        self._next_try = now + self._backoff
        if now - self._outage_warned >= OUTAGE_WARN_EVERY_S:
            self._outage_warned = now
            log.warning("run %s rank %d: %s; %d segment(s) wait in %s and are uploaded when it is back (training goes "
                        "on; retried at every flush, out of reach for %.0f s so far)", self.run_id, self.rank, e,
                        len(self._unsent), self._spool, now - self._outage_since)

    def _note_back(self) -> None:
        if self._outage_since is not None:
            log.warning("run %s rank %d: %s is reachable again after %.0f s; every buffered segment is uploaded",
                        self.run_id, self.rank, self.bucket.url, time.monotonic() - self._outage_since)
            self._outage_since = None
            self._outage_warned = 0.0

    # ---------------------------------------------------------------- the end
    def finish(self, status: str = "finished", timeout: float | None = None) -> None:
        super().finish(status, timeout)
        if self._published and not self._unsent:
            shutil.rmtree(self._spool, ignore_errors=True)

    def discard_previous(self) -> None:
        prev, self._previous = self._previous, None
        if not prev:
            return
        keep = {_manifest_key(self.run_id, self.rank), f"{_run_prefix(self.run_id)}/{layout.RUN_FILE}"}
        keep |= {self._key(t, s["file"]) for t, segs in self._manifest["segments"].items() for s in segs}
        for key in prev["keys"]:
            if key not in keep:
                try:
                    self.bucket.delete(key)
                except StoreError as e:
                    log.warning("overwrite: could not delete %s of the old run (%s); it is never listed again", key, e)

    def restore_previous(self) -> bool:
        prev, self._previous = self._previous, None
        if not prev:
            return False
        mine = {self._key(t, s["file"]) for t, segs in self._manifest["segments"].items() for s in segs}
        for key, data in prev["json"].items():
            if key == _manifest_key(self.run_id, self.rank):
                self._etag = self.bucket.put(key, data, if_match=self._etag)
            else:
                self.bucket.put(key, data)
        for key in mine - set(prev["keys"]):
            self.bucket.delete(key)
        log.warning("restored the previous version of run %s in %s", self.run_id, self.bucket.url)
        return True
