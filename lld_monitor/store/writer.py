"""The trainer side of the store: one RunWriter per (run, rank) process.

Each flush writes one Parquet segment per table that has new rows (temp name + os.replace), then
atomically replaces this rank's manifest, which lists the live segments. A reader that reads the
manifest sees every segment it lists complete, and a prefix of what this rank appended.
Segments are merged as the run goes (size-tiered: `compact_fanout` segments of one level become one
of the next level) and into one file per table at `finish()`, so a run holds few files. Merged-away
segments stay on disk for `retire_grace_s` so a reader that planned a query on the previous manifest
can finish it.

A store in a bucket (`s3://...`) gets `bucket_writer.BucketRunWriter`, this class with its file operations done as
create-only and conditional PUTs (no rename anywhere); `RunWriter.create` picks the kind from the store argument.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import layout, liveness, schema, stepset
from .bucket_writer import BucketWriting
from .convert import conform, schema_fingerprint, to_table
from .errors import BucketUnavailable, StoreError
from .location import is_bucket
from .storedir import open_store_for_write

log = logging.getLogger(__name__)


@dataclass
class WriterConfig:
    compact_fanout: int = 8  # this many segments of one level are merged into one of the next level
    retire_grace_s: float = 5.0  # merged-away segments are deleted after this long
    compression: str = "snappy"
    merge_row_group_rows: int = 256 * 1024  # row-group size of merged segments
    final_compaction: bool = True  # merge each table into one file per rank at finish()
    background_compaction: bool = True  # tiered merges in a writer-side thread, not inside flush()
    max_segments_per_table: int = 24  # above this (compactor behind), flush() compacts before returning


def _now_iso() -> str:
    return layout.iso(layout.utcnow())  # type: ignore[return-value]


def _write_parquet_atomic(table: pa.Table, path: Path, compression: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression=compression)
    os.replace(tmp, path)


class RunWriter:
    """Writes one rank of one run. Create it with `RunWriter.create(...)`; thread-safe."""

    def __init__(self, store: Path, run_id: str, rank: int, record: dict[str, Any], manifest: dict[str, Any],
                 cfg: WriterConfig, trash: Path | None = None):
        self.store = store
        self.run_id = run_id
        self.rank = rank
        self.cfg = cfg
        self._record = record
        self._manifest = manifest
        self._trash = trash
        self._buffers: dict[str, list[pa.Table]] = {t: [] for t in layout.DATA_TABLES}
        self._lock = threading.RLock()
        self._finished = False
        self._compactor: threading.Thread | None = None
        self._compact_wake = threading.Event()
        self._compact_stop = False
        self._inflight: set[str] = set()  # segments the background compactor is merging now
        self.rows_written: dict[str, int] = {t: 0 for t in layout.DATA_TABLES}

    # ---------------------------------------------------------------- creation
    @classmethod
    def create(
        cls,
        store_path: str | os.PathLike,
        name: str,
        mode: str,
        source: str = "local",
        config: dict | None = None,
        model: str | None = None,
        run_id: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        overwrite: bool = False,
        writer_config: WriterConfig | None = None,
    ) -> "RunWriter":
        """Start writing a run (rank 0) or join one (rank > 0, same run_id). `store_path`: a folder, or a bucket
        prefix (`s3://bucket/prefix`: see bucket_writer.py)."""
        run_id = cls._check_args(name, mode, source, rank, world_size, run_id)
        if is_bucket(store_path):
            return BucketRunWriter.create_in_bucket(
                str(store_path), name, mode, source=source, config=config, model=model, run_id=run_id, rank=rank,
                world_size=world_size, overwrite=overwrite, writer_config=writer_config or WriterConfig())
        store = open_store_for_write(store_path)
        rdir = layout.run_dir(store, run_id)
        mpath = layout.manifest_path(store, run_id, rank)
        trash = None
        if mpath.exists():
            if not overwrite:
                raise StoreError(
                    f"run {run_id!r} (rank {rank}) already exists in {store}; nothing was changed. "
                    "Pass overwrite=True to replace it, or use another run_id."
                )
            trash = store / layout.RUNS_DIR / f".trash-{run_id}-{time.time_ns()}"
            os.replace(rdir, trash)
            log.info("overwrite: moved the old run %s aside to %s until the new one finishes", run_id, trash.name)
        record, manifest = cls._new_record(run_id, name, mode, source, config, model, rank, world_size)
        rdir.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            layout.write_json_atomic(rdir / layout.RUN_FILE, record)
        else:
            layout.create_json_exclusive(rdir / layout.RUN_FILE, record)  # placeholder until rank 0 writes
        layout.write_json_atomic(mpath, manifest)
        w = cls(store, run_id, rank, record, manifest, writer_config or WriterConfig(), trash)
        log.debug("writing run %s rank %d into %s", run_id, rank, store)
        return w

    @staticmethod
    def _check_args(name: str, mode: str, source: str, rank: int, world_size: int, run_id: str | None) -> str:
        """Validate what create() was given; returns the run_id (a new one for rank 0 without one)."""
        if not isinstance(name, str) or not name.strip():
            raise StoreError("a run needs a non-empty name")
        if mode not in schema.MODES:
            raise StoreError(f"mode {mode!r} is not one of {schema.MODES}")
        if source not in schema.SOURCES:
            raise StoreError(f"source {source!r} is not one of {schema.SOURCES}")
        if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
            raise StoreError(f"rank {rank!r} must be an int in [0, world_size={world_size!r})")
        if run_id is None:
            if rank > 0:
                raise StoreError("rank > 0 must pass the run_id of rank 0 (broadcast it, e.g. with torch.distributed)")
            run_id = layout.new_run_id(name)
        elif not layout.valid_run_id(run_id):
            raise StoreError(
                f"run_id {run_id!r} is not filesystem-safe: use letters, digits, '.', '_' and '-' (max 128); "
                "free text belongs in the run name"
            )
        return run_id

    @staticmethod
    def _new_record(run_id: str, name: str, mode: str, source: str, config: dict | None, model: str | None,
                    rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The run record and the empty manifest of a new writer."""
        now = _now_iso()
        ident = liveness.writer_identity()
        record = {
            "run_id": run_id,
            "name": name,
            "mode": mode,
            "source": source,
            "status": "running",
            "config": config or {},
            "model": model,
            "started_at": now,
            "ended_at": None,
            "updated_at": now,
            "world_size": world_size,
            "schema_version": schema.SCHEMA_VERSION,
            "writer": {**ident, "rank": rank},
        }
        manifest = {
            "run_id": run_id,
            "rank": rank,
            "world_size": world_size,
            "writer": ident,
            "status": "running",
            "started_at": now,
            "heartbeat": now,
            "ended_at": None,
            "seq": 0,
            "segments": {t: [] for t in layout.DATA_TABLES},
            "retired": [],
        }
        return record, manifest

    # ---------------------------------------------------------------- properties
    @property
    def path(self) -> Path:
        return layout.run_dir(self.store, self.run_id)

    @property
    def finished(self) -> bool:
        return self._finished

    # ---------------------------------------------------------------- writing
    def append(self, table_name: str, rows: Any) -> int:
        """Buffer rows for `table_name` (run_id filled in; rank defaults to this writer's). Returns the row count."""
        if table_name not in layout.DATA_TABLES:
            raise StoreError(
                f"unknown table {table_name!r}; data tables are {layout.DATA_TABLES} "
                "(the runs row is kept by RunWriter itself)"
            )
        if self.rank > 0 and table_name not in ("samples", "tokens"):
            raise StoreError(f"rank {self.rank} may write samples and tokens only; {table_name!r} is rank 0's job")
        sch = schema.TABLES[table_name]
        defaults: dict[str, Any] = {}
        if "rank" in sch.names:
            defaults["rank"] = self.rank
        if table_name == "steps":
            defaults["time"] = layout.utcnow()
        tbl = to_table(table_name, rows, sch, force={"run_id": self.run_id}, defaults=defaults)
        if tbl.num_rows and tbl.column("step").null_count:
            raise StoreError(f"table {table_name!r}: every row needs a step")
        with self._lock:
            self._check_open()
            if tbl.num_rows:
                self._buffers[table_name].append(tbl)
        return tbl.num_rows

    def flush(self) -> None:
        """Make everything appended so far visible to readers (one segment per table, one manifest write).

        Compaction runs in a background thread (WriterConfig.background_compaction), so this returns
        after writing the new segments."""
        with self._lock:
            self._check_open()
            self._flush_locked()
            behind = max(len(v) for v in self._manifest["segments"].values()) > self.cfg.max_segments_per_table
            if not self.cfg.background_compaction or behind:
                self._compact_locked(final=False)
            self._delete_retired_locked(force=False)
        if self.cfg.background_compaction:
            self._kick_compactor()

    def heartbeat(self) -> None:
        """Tell readers this writer is alive (RunLogger calls it every flush interval)."""
        with self._lock:
            if self._finished:
                return
            self._manifest["heartbeat"] = _now_iso()
            self._write_manifest()

    def finish(self, status: str = "finished", timeout: float | None = None) -> None:
        """Final flush, final compaction, status. Idempotent.

        `timeout` (seconds) bounds the wait for another thread's flush (signal handlers use it)."""
        if status not in schema.STATUSES or status == "running":
            raise StoreError(f"finish(status=...) takes 'finished' or 'crashed', not {status!r}")
        self._stop_compactor(timeout)
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise StoreError(f"run {self.run_id!r}: another thread holds the writer; could not finish in {timeout} s")
        try:
            if self._finished:
                return
            try:
                self._flush_locked()
                if self.cfg.final_compaction:
                    self._compact_locked(final=True)
            finally:
                now = _now_iso()
                self._manifest.update(status=status, ended_at=now, heartbeat=now)
                self._write_manifest()
                if self.rank == 0:
                    self._record.update(status=status, ended_at=now, updated_at=now)
                    self._write_record()
                self._finished = True
                self._delete_retired_locked(force=True)
                if status == "finished":
                    self.discard_previous()
            log.debug("run %s rank %d %s", self.run_id, self.rank, status)
        finally:
            self._lock.release()

    def update_run(self, **fields: Any) -> None:
        """Change fields of the runs row (rank 0): e.g. config or model known only after start."""
        if self.rank != 0:
            raise StoreError("only rank 0 writes the runs row")
        bad = [k for k in fields if k not in schema.RUNS.names or k in ("run_id", "schema_version", "status")]
        if bad:
            raise StoreError(f"update_run: cannot set {bad}")
        with self._lock:
            self._record.update(fields, updated_at=_now_iso())
            self._write_record()

    def discard_previous(self) -> None:
        """Delete the run that `overwrite=True` set aside (finish("finished") does it; an importer whose crashed
        import is still the newest copy calls it too). Idempotent."""
        if self._trash is not None:
            shutil.rmtree(self._trash, ignore_errors=True)
            self._trash = None

    def restore_previous(self) -> bool:
        """Put back the run that `overwrite=True` set aside, dropping what this writer wrote (a failed re-import
        must not lose the earlier one). Call after finish(). True if there was one to restore."""
        trash = self._trash
        if trash is None or not trash.exists():
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        os.replace(trash, self.path)
        self._trash = None
        return True

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish("crashed" if exc_type is not None else "finished")

    # ---------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._finished:
            raise StoreError(f"run {self.run_id!r} rank {self.rank} is already finished; create a new RunWriter")

    def _next_name(self, level: int) -> str:
        self._manifest["seq"] += 1
        return f"r{self.rank}-{self._manifest['seq']:09d}-L{level}.parquet"

    # the file operations (bucket_writer.BucketRunWriter does them on object storage)
    def _write_manifest(self) -> None:
        layout.write_json_atomic(layout.manifest_path(self.store, self.run_id, self.rank), self._manifest)

    def _write_record(self) -> None:
        layout.write_json_atomic(self.path / layout.RUN_FILE, self._record)

    def _put_segment(self, table: str, fname: str, tbl: pa.Table) -> str:
        """Write a new segment; returns the name it got (a bucket writer may have to pick the next free one)."""
        tdir = self.path / table
        tdir.mkdir(exist_ok=True)
        _write_parquet_atomic(tbl, tdir / fname, self.cfg.compression)
        return fname

    def _segment_file(self, table: str, fname: str) -> Path:
        """A local file holding the segment (merges read it)."""
        return self.path / table / fname

    def _merge_tmp(self, table: str, fname: str) -> Path:
        return self.path / table / f".{fname}.tmp"

    def _publish_merged(self, table: str, fname: str, tmp: Path) -> str:
        os.replace(tmp, self.path / table / fname)
        return fname

    def _drop_unpublished(self, table: str, fname: str) -> None:
        (self.path / table / fname).unlink(missing_ok=True)

    def _delete_segment(self, relpath: str) -> None:
        try:
            os.unlink(self.path / relpath)
        except FileNotFoundError:
            pass

    def _flush_locked(self) -> None:
        wrote = False
        for t, parts in self._buffers.items():
            if not parts:
                continue
            tbl = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            fname = self._put_segment(t, self._next_name(0), tbl)
            self._manifest["segments"][t].append({"file": fname, "level": 0, "rows": tbl.num_rows,
                                                  "schema": schema_fingerprint(t),
                                                  "steps": stepset.compress(stepset.of_table(tbl))})
            self.rows_written[t] += tbl.num_rows
            self._buffers[t] = []
            wrote = True
        # the heartbeat goes out with every flush, with or without new rows
        self._manifest["heartbeat"] = _now_iso()
        self._write_manifest()
        if wrote:
            log.debug("run %s rank %d: flushed", self.run_id, self.rank)

    def _merge(self, table: str, segs: list[dict[str, Any]], level: int, fname: str) -> dict[str, Any]:
        """Stream `segs` into one new segment `fname` (needs no lock: segments are immutable)."""
        sch = schema.TABLES[table]
        tmp = self._merge_tmp(table, fname)
        rows = 0
        steps: set[int] = set()  # read from the data, not the inputs' entries: older segments have none
        pending: list[pa.Table] = []
        pending_rows = 0
        with pq.ParquetWriter(tmp, sch, compression=self.cfg.compression) as pw:
            for s in segs:
                # batch by batch, never a whole segment: a merged segment can hold millions of rows
                with pq.ParquetFile(self._segment_file(table, s["file"])) as pf:
                    for batch in pf.iter_batches(batch_size=self.cfg.merge_row_group_rows):
                        part = conform(pa.Table.from_batches([batch]), sch)
                        steps |= stepset.of_table(part)
                        pending.append(part)
                        pending_rows += part.num_rows
                        if pending_rows >= self.cfg.merge_row_group_rows:
                            pw.write_table(pa.concat_tables(pending), row_group_size=self.cfg.merge_row_group_rows)
                            rows += pending_rows
                            pending, pending_rows = [], 0
            if pending:
                pw.write_table(pa.concat_tables(pending), row_group_size=self.cfg.merge_row_group_rows)
                rows += pending_rows
        fname = self._publish_merged(table, fname, tmp)
        return {"file": fname, "level": level, "rows": rows, "schema": schema_fingerprint(table),
                "steps": stepset.compress(steps)}

    def _pick_job_locked(self) -> tuple[str, list[dict[str, Any]], int, str] | None:
        """The next size-tiered merge: the first `compact_fanout` segments of the lowest full level."""
        fan = max(2, self.cfg.compact_fanout)
        for t in layout.DATA_TABLES:
            by_level: dict[int, list[dict[str, Any]]] = {}
            for seg in self._manifest["segments"][t]:
                if seg["file"] not in self._inflight:
                    by_level.setdefault(seg["level"], []).append(seg)
            for lv in sorted(by_level):
                if len(by_level[lv]) >= fan:
                    return t, by_level[lv][:fan], lv + 1, self._next_name(lv + 1)
        return None

    def _apply_job_locked(self, table: str, group: list[dict[str, Any]], merged: dict[str, Any]) -> None:
        """Swap the merged segment in for its inputs (in place of the first) and publish the manifest."""
        names = {g["file"] for g in group}
        segs: list[dict[str, Any]] = []
        for seg in self._manifest["segments"][table]:
            if seg["file"] == group[0]["file"]:
                segs.append(merged)
            elif seg["file"] not in names:
                segs.append(seg)
        self._manifest["segments"][table] = segs
        now = time.time()
        self._manifest["retired"] += [{"path": f"{table}/{g['file']}", "at": now} for g in group]
        self._write_manifest()

    def _compact_locked(self, final: bool) -> None:
        """Synchronous compaction (the caller holds the lock): tiered merges, or everything at finish."""
        if final:
            for t in layout.DATA_TABLES:
                segs = self._manifest["segments"][t]
                if len(segs) > 1:
                    level = max(s["level"] for s in segs) + 1
                    self._apply_job_locked(t, list(segs), self._merge(t, list(segs), level, self._next_name(level)))
            return
        while (job := self._pick_job_locked()) is not None:
            t, group, level, fname = job
            self._apply_job_locked(t, group, self._merge(t, group, level, fname))

    # background compaction: merges run outside the lock, so flush() only writes the new segments
    def _kick_compactor(self) -> None:
        if self._compactor is None:
            self._compactor = threading.Thread(target=self._compactor_loop, daemon=True,
                                               name=f"compact[{self.run_id}:{self.rank}]")
            self._compactor.start()
        self._compact_wake.set()

    def _compactor_loop(self) -> None:
        while True:
            self._compact_wake.wait()
            self._compact_wake.clear()
            while not self._compact_stop:
                with self._lock:
                    if self._finished or self._compact_stop:
                        return
                    job = self._pick_job_locked()
                    if job is not None:
                        self._inflight.update(g["file"] for g in job[1])
                if job is None:
                    break
                t, group, level, fname = job
                try:
                    merged = self._merge(t, group, level, fname)
                except BucketUnavailable as e:  # the bucket is out of reach: merge again after the next flush
                    log.info("run %s rank %d: compaction of %s waits for the bucket (%s)", self.run_id, self.rank, t, e)
                    with self._lock:
                        self._inflight.clear()
                    break
                except Exception:  # noqa: BLE001 - segments stay as they are; readers are unaffected
                    log.exception("run %s rank %d: background compaction of %s failed", self.run_id, self.rank, t)
                    with self._lock:
                        self._inflight.clear()
                    return
                with self._lock:
                    self._inflight.difference_update(g["file"] for g in group)
                    if self._finished or self._compact_stop:
                        self._drop_unpublished(t, merged["file"])
                        return
                    self._apply_job_locked(t, group, merged)
            with self._lock:
                if not self._finished:
                    self._delete_retired_locked(force=False)
            if self._compact_stop:
                return

    def _stop_compactor(self, timeout: float | None) -> None:
        self._compact_stop = True
        self._compact_wake.set()
        if self._compactor is not None and self._compactor is not threading.current_thread():
            self._compactor.join(timeout)

    def _delete_retired_locked(self, force: bool) -> None:
        keep = []
        now = time.time()
        for r in self._manifest["retired"]:
            if force or now - r["at"] >= self.cfg.retire_grace_s:
                try:
                    self._delete_segment(r["path"])
                except StoreError as e:  # a bucket out of reach: try again at the next flush
                    log.debug("could not delete %s yet: %s", r["path"], e)
                    keep.append(r)
            else:
                keep.append(r)
        if len(keep) != len(self._manifest["retired"]):
            self._manifest["retired"] = keep
            self._write_manifest()


class BucketRunWriter(BucketWriting, RunWriter):
    """RunWriter on object storage: the same segments, manifest and compaction, written with create-only and
    conditional PUTs instead of renames (bucket_writer.py)."""
