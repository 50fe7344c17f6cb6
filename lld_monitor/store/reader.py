"""The dashboard side of the store: read-only, never locks anything a writer needs.

Every query plans over the Parquet segments that the runs' manifests list *now* (manifests are
re-read when their file changed), through an in-memory DuckDB connection. A segment that vanished
between planning and reading (merged away by the writer) makes the query retry on fresh manifests;
the caller never sees that race.

A store in a bucket (`s3://bucket/prefix`) is read through a local mirror (`mirror.py`): before each query the
mirror brings the metadata up to date (at most every `poll_s`) and fetches the segments the query reads, so DuckDB
only ever opens local files. A writer's liveness is judged on one clock (`_heartbeat_age`): the server's for a
bucket, this process's monotonic clock for a folder, never the writer's against the reader's.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from . import detector_cache, layout, liveness, migrations, schema, stepset
from .convert import conform, schema_fingerprint
from .errors import RunNotFoundError, StoreError
from .location import is_bucket
from .storedir import inspect_store

log = logging.getLogger(__name__)

_DUCK_TYPES = {
    pa.string(): "VARCHAR",
    pa.int64(): "BIGINT",
    pa.int32(): "INTEGER",
    pa.float64(): "DOUBLE",
    pa.float32(): "FLOAT",
    pa.bool_(): "BOOLEAN",
    pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ",
}
_TRANSIENT = (duckdb.IOException, duckdb.InvalidInputException, FileNotFoundError)

RUN_LIST_COLUMNS = list(schema.RUNS.names) + ["steps", "last_step"]
# integer / boolean columns holding NULLs come back as pandas' nullable dtypes, as DuckDB's .df() returns them
_NULLABLE: dict[pa.DataType, Any] = {
    pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(), pa.int64(): pd.Int64Dtype(),
    pa.uint8(): pd.UInt8Dtype(), pa.uint16(): pd.UInt16Dtype(), pa.uint32(): pd.UInt32Dtype(),
    pa.uint64(): pd.UInt64Dtype(), pa.bool_(): pd.BooleanDtype(),
}


def _frame(table: pa.Table) -> pd.DataFrame:
    """An Arrow result as the DataFrame DuckDB's `.df()` gives (same dtypes, nullable where a column has NULLs).
    Through Arrow because `.df()` builds string columns value by value: 0.75 s for a 200,000-step `steps` table,
    of which 0.5 s is its run_id column, against 0.09 s this way."""
    df = table.to_pandas()
    for i, col in enumerate(table.columns):
        dtype = _NULLABLE.get(col.type)
        if dtype is not None and col.null_count:
            df.isetitem(i, col.to_pandas(types_mapper={col.type: dtype}.get))
        elif not table.num_rows and pa.types.is_string(col.type):
            df.isetitem(i, df.iloc[:, i].astype(object))  # .df() gives an empty text column as object
    return df


@dataclass
class RunState:
    """What the reader knows of one run right now."""

    record: dict[str, Any]
    status: str
    updated_at: str | None
    ranks: list[int]
    files: dict[str, list[str]] = field(default_factory=dict)
    current: dict[str, bool] = field(default_factory=dict)  # every segment has the current schema
    # file -> the steps its manifest entry lists (stepset runs), None for segments written before entries had them
    segment_steps: dict[str, list | None] = field(default_factory=dict)


class StoreReader:
    """Read-only view of a store. Methods return pandas DataFrames; thread-safe."""

    def __init__(self, path: str | os.PathLike, *, stale_after_s: float | None = None,
                 retries: int = 20, retry_sleep_s: float = 0.05, mirror_dir: str | os.PathLike | None = None,
                 poll_s: float | None = None):
        """`path`: a store folder, or a bucket prefix (`s3://bucket/prefix`), read through a local mirror
        (`mirror_dir`, default under the user cache folder) synced at most every `poll_s` (1 s)."""
        self._mirror = None
        if is_bucket(path):
            from .mirror import POLL_S, BucketMirror

            self._mirror = BucketMirror(str(path), mirror_dir, poll_s=POLL_S if poll_s is None else poll_s)
            self.path, self.schema_version = self._mirror.root, self._mirror.version
            self.location = self._mirror.url
        else:
            self.path, self.schema_version = inspect_store(path)
            self.location = str(self.path)
        self._beats = liveness.HeartbeatWatch()
        self.stale_after_s = liveness.stale_after_s() if stale_after_s is None else stale_after_s
        self.retries = retries
        self.retry_sleep_s = retry_sleep_s
        self._con = duckdb.connect(":memory:")
        self._con.execute("SET TimeZone='UTC'")
        self._lock = threading.RLock()
        self._json_cache: dict[Path, tuple[tuple[int, int, int], Any]] = {}
        self._views: set[str] = set()
        self.cache_entries = 64
        self._result_cache: OrderedDict[tuple, pd.DataFrame | list[int]] = OrderedDict()  # list: token_steps
        self._counts_cache: OrderedDict[tuple, tuple[int, int | None]] = OrderedDict()
        self.transient_retries = 0  # races absorbed (a segment merged away mid-query); never seen by callers

    # ---------------------------------------------------------------- metadata
    def _read_json_cached(self, path: Path) -> Any:
        st = path.stat()
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        hit = self._json_cache.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        obj = layout.read_json(path)
        self._json_cache[path] = (key, obj)
        return obj

    def _run_state(self, rdir: Path) -> RunState | None:
        try:
            rec = self._read_json_cached(rdir / layout.RUN_FILE)
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("skipping run folder %s: its %s is unreadable (%s)", rdir.name, layout.RUN_FILE, e)
            return None
        version = int(rec.get("schema_version", self.schema_version or 0) or 0)
        if version > schema.SCHEMA_VERSION:
            log.warning("skipping run %s: written with schema_version %d (newer than %d); upgrade lld-monitor",
                        rdir.name, version, schema.SCHEMA_VERSION)
            return None
        rec = migrations.upgrade_run_record(rec, version)
        now = layout.utcnow()
        files: dict[str, list[str]] = {t: [] for t in layout.DATA_TABLES}
        current: dict[str, bool] = {t: True for t in layout.DATA_TABLES}
        statuses: list[str] = []
        beats: list[str] = [t for t in (rec.get("updated_at"),) if t]
        ranks: list[int] = []
        segment_steps: dict[str, list | None] = {}
        for mpath in sorted(rdir.glob(f"{layout.MANIFEST_PREFIX}*.json")):
            try:
                man = self._read_json_cached(mpath)
            except FileNotFoundError:
                continue
            except (ValueError, UnicodeDecodeError) as e:
                log.warning("run %s: manifest %s unreadable (%s); its segments are not shown", rdir.name, mpath.name, e)
                statuses.append("crashed")
                continue
            ranks.append(int(man.get("rank", 0)))
            for t, segs in man.get("segments", {}).items():
                if t in files:
                    files[t] += [str(rdir / t / s["file"]) for s in segs]
                    segment_steps.update((str(rdir / t / s["file"]), s.get("steps")) for s in segs)
                    fp = schema_fingerprint(t)
                    current[t] = current[t] and all(s.get("schema") == fp for s in segs)
            st = man.get("status", "running")
            beat = man.get("heartbeat")
            if beat:
                beats.append(beat)
            if st == "running":
                age = self._heartbeat_age(mpath, beat)
                if not liveness.writer_alive(man.get("writer", {}), age, self.stale_after_s):
                    st = "crashed"
            statuses.append(st)
        if not statuses:  # no manifest (older layouts, imports): the record alone tells
            st = rec.get("status", "finished")
            if st == "running":
                beat = rec.get("updated_at")
                age = (now - layout.parse_iso(beat)).total_seconds() if beat else None
                if not liveness.writer_alive(rec.get("writer", {}), age, self.stale_after_s):
                    st = "crashed"
            statuses.append(st)
        if "crashed" in statuses:
            status = "crashed"
        elif "running" in statuses:
            status = "running"
        else:
            status = rec.get("status", "finished")
            status = "finished" if status == "running" else status
        updated = max(beats, key=lambda t: layout.parse_iso(t)) if beats else None
        return RunState(record=rec, status=status, updated_at=updated, ranks=ranks, files=files, current=current,
                        segment_steps=segment_steps)

    def _heartbeat_age(self, mpath: Path, beat: str | None) -> float | None:
        """Seconds since the writer of this manifest last wrote it, on one clock: the server's (a bucket), or this
        process's monotonic clock since the heartbeat last changed (a folder; the first sight counts from the file's
        mtime, the folder's clock). Never the writer's timestamp against this machine's clock (hosts' clocks differ)."""
        if self._mirror is not None:
            age = self._mirror.heartbeat_age(mpath)
            if age is not None:
                return age
        if not beat:
            return None
        try:
            first = max(0.0, time.time() - mpath.stat().st_mtime)
        except OSError:
            first = 0.0
        return self._beats.age(str(mpath), beat, first)

    def _sync(self) -> None:
        if self._mirror is not None:
            self._mirror.sync()

    def _ensure(self, files: list[str]) -> None:
        """The mirror fetches what a query is about to read (a folder store has it all)."""
        if self._mirror is not None and files:
            self._mirror.ensure(files)

    def _states(self) -> dict[str, RunState]:
        self._sync()
        root = self.path / layout.RUNS_DIR
        out: dict[str, RunState] = {}
        if not root.is_dir():
            return out
        for rdir in sorted(root.iterdir()):
            if rdir.name.startswith(".") or not rdir.is_dir():
                continue
            stt = self._run_state(rdir)
            if stt is not None:
                out[stt.record.get("run_id", rdir.name)] = stt
        return out

    # ---------------------------------------------------------------- query plumbing
    def _relation(self, table: str, files: list[str]) -> duckdb.DuckDBPyRelation:
        sch = schema.TABLES[table]
        if files:
            rel = self._con.read_parquet(files, union_by_name=True)
        else:
            rel = self._con.from_arrow(sch.empty_table())
        present = set(rel.columns)
        exprs = [f'"{f.name}"' if f.name in present else f'CAST(NULL AS {_DUCK_TYPES[f.type]}) AS "{f.name}"' for f in sch]
        exprs += [f'"{c}"' for c in rel.columns if c not in sch.names]
        return rel.project(", ".join(exprs))

    def _retry(self, fn):
        last: Exception | None = None
        for attempt in range(self.retries):
            try:
                with self._lock:
                    return fn()
            except _TRANSIENT as e:  # a segment merged away under us, or a manifest mid-replace
                last = e
                self.transient_retries += 1
                log.debug("transient read error (retrying on fresh manifests): %s", e)
                self._json_cache.clear()
                if self._mirror is not None:
                    self._mirror.invalidate()
                time.sleep(self.retry_sleep_s * min(attempt + 1, 4))
        raise StoreError(f"could not read the store at {self.location} after {self.retries} tries: {last}") from last

    def _run_query(self, run_id: str, table: str, sql: str, params: list | None = None) -> pd.DataFrame:
        """`sql` reads the run's `table` as `{src}`. Results are cached per (query, segment list): a finished
        run, or a live one between two flushes, is answered without touching DuckDB."""

        def go() -> pd.DataFrame:
            st = self._state(run_id)
            files = st.files[table]
            self._ensure(files)

            def query() -> pd.DataFrame:
                if files and st.current[table]:
                    # one statement straight over the segments (all have exactly the current columns)
                    return _frame(self._con.sql(sql.format(src="read_parquet(?)"), params=[files, *(params or [])])
                                  .to_arrow_table())
                self._relation(table, files).create_view("_q", replace=True)
                return _frame(self._con.sql(sql.format(src="_q"), params=params or []).to_arrow_table())

            return self._cached((sql, repr(params), tuple(files)), query)

        return self._retry(go)

    def _cached(self, key: tuple, compute):
        """`compute()` once per key (a key names its segment list), kept in an LRU of `cache_entries`; callers get
        a copy, so nothing they do changes the cached value."""
        hit = self._result_cache.get(key)
        if hit is not None:
            self._result_cache.move_to_end(key)
            return hit.copy()
        value = compute()
        self._result_cache[key] = value
        while len(self._result_cache) > self.cache_entries:
            self._result_cache.popitem(last=False)
        return value.copy()

    def _state(self, run_id: str) -> RunState:
        self._sync()
        rdir = layout.run_dir(self.path, run_id) if layout.valid_run_id(run_id) else None
        st = self._run_state(rdir) if rdir is not None and rdir.is_dir() else None
        if st is None:
            raise RunNotFoundError(f"no run with id {run_id!r} in {self.location}; see r.runs() or `lld-monitor runs`")
        return st

    # ---------------------------------------------------------------- public API
    def runs(self) -> pd.DataFrame:
        """One row per run: schema.RUNS columns + steps (rows stored) + last_step. Newest first."""

        def go() -> pd.DataFrame:
            states = self._states()
            self._ensure([f for st in states.values() for f in st.files["steps"]])
            return self._runs_frame(states, self._step_counts(states))

        return self._retry(go)

    def _step_counts(self, states: dict[str, RunState]) -> dict[str, tuple[int, int | None]]:
        """run_id -> (distinct steps, last step), cached per run on its steps segment list; the runs not
        cached yet are counted in one statement."""
        out: dict[str, tuple[int, int | None]] = {}
        todo: dict[str, list[str]] = {}
        for rid, st in states.items():
            files = st.files["steps"]
            if not files:
                continue
            hit = self._counts_cache.get(tuple(files))
            if hit is not None:
                out[rid] = hit
            elif st.current["steps"]:
                todo[rid] = files
            else:
                self._relation("steps", files).create_view("_q", replace=True)
                row = self._con.execute("SELECT count(DISTINCT step), max(step) FROM _q").fetchall()[0]
                out[rid] = self._remember_counts(files, row)
        if todo:
            all_files = [f for fs in todo.values() for f in fs]
            try:
                rows = self._con.execute(
                    "SELECT run_id, count(DISTINCT step), max(step) FROM read_parquet(?) GROUP BY run_id", [all_files]
                ).fetchall()
            except duckdb.Error:
                if not all(os.path.exists(f) for f in all_files):
                    raise  # a segment merged away under us: _retry re-plans on fresh manifests
                rows = self._count_each(todo)  # a damaged segment: count run by run, so only its run is hit
            found = {r[0]: r[1:] for r in rows}
            for rid, files in todo.items():
                out[rid] = self._remember_counts(files, found.get(rid, (0, None)))
        return out

    def _count_each(self, todo: dict[str, list[str]]) -> list[tuple]:
        """Per-run counts; a run whose (present) steps segments cannot be read is listed with 0 steps and a
        warning instead of failing the whole run list (reading that run says what is wrong)."""
        rows = []
        for rid, files in todo.items():
            try:
                row = self._con.execute("SELECT count(DISTINCT step), max(step) FROM read_parquet(?)", [files]).fetchall()[0]
                rows.append((rid, *row))
            except duckdb.Error as e:
                if not all(os.path.exists(f) for f in files):
                    raise
                log.warning("run %s: its steps segments could not be read (%s); listed with 0 steps", rid, e)
        return rows

    def _remember_counts(self, files: list[str], row: Any) -> tuple[int, int | None]:
        val = (int(row[0]), None if row[1] is None else int(row[1]))
        self._counts_cache[tuple(files)] = val
        while len(self._counts_cache) > 4096:
            self._counts_cache.popitem(last=False)
        return val

    def _runs_frame(self, states: dict[str, RunState], counts: dict[str, tuple[int, int]]) -> pd.DataFrame:
        rows = []
        for rid, st in states.items():
            rec = st.record
            n, last = counts.get(rid, (0, None))
            rows.append({
                "run_id": rid,
                "name": rec.get("name"),
                "mode": rec.get("mode", "unknown"),
                "source": rec.get("source", "local"),
                "status": st.status,
                "config": layout.dumps(rec.get("config") or {}),
                "model": rec.get("model"),
                "started_at": rec.get("started_at"),
                "ended_at": rec.get("ended_at") if st.status != "running" else None,
                "updated_at": st.updated_at,
                "world_size": int(rec.get("world_size") or 1),
                "schema_version": int(rec.get("schema_version") or schema.SCHEMA_VERSION),
                "steps": int(n),
                "last_step": None if last is None else int(last),
            })
        df = pd.DataFrame(rows, columns=RUN_LIST_COLUMNS)
        for c in ("started_at", "ended_at", "updated_at"):
            df[c] = pd.to_datetime(df[c], utc=True, format="ISO8601")
        df["world_size"] = df["world_size"].astype("int32")
        df["schema_version"] = df["schema_version"].astype("int32")
        df["steps"] = df["steps"].astype("int64")
        df["last_step"] = df["last_step"].astype("Int64")
        if len(df):
            df = df.sort_values("started_at", ascending=False, kind="stable").reset_index(drop=True)
        return df

    def run(self, run_id_or_name: str) -> dict[str, Any]:
        """One run row as a dict; looks up a run_id first, then an exact name (ambiguous -> newest)."""
        df = self.runs()
        hit = df[df["run_id"] == run_id_or_name]
        if hit.empty:
            hit = df[df["name"] == run_id_or_name]
        if hit.empty:
            known = ", ".join(repr(n) for n in df["name"].head(10))
            raise RunNotFoundError(
                f"no run with id or name {run_id_or_name!r} in {self.location}" + (f"; runs include {known}" if known else "")
            )
        row = hit.sort_values("started_at", ascending=False).iloc[0].to_dict()
        return {k: (None if (v is pd.NA or v is pd.NaT) else v) for k, v in row.items()}

    def steps(self, run_id: str, columns: list[str] | None = None) -> pd.DataFrame:
        cols = list(schema.STEPS.names) if columns is None else list(columns)
        bad = [c for c in cols if c not in schema.STEPS.names]
        if bad:
            raise StoreError(f"unknown steps column(s) {bad}; known: {schema.STEPS.names}")
        if "step" not in cols:
            cols = ["step"] + cols
        sel = ", ".join(f'"{c}"' for c in cols)
        return self._run_query(run_id, "steps", f"SELECT {sel} FROM {{src}} ORDER BY step")

    def metrics(self, run_id: str, keys: list[str] | None = None) -> pd.DataFrame:
        if keys is None:
            return self._run_query(run_id, "metrics", "SELECT step, key, value FROM {src} ORDER BY step, key")
        return self._run_query(run_id, "metrics", "SELECT step, key, value FROM {src} WHERE list_contains(?, key) "
                               "ORDER BY step, key", [list(keys)])

    def signals(self, run_id: str) -> pd.DataFrame:
        """steps + metrics pivoted wide: one row per step, STEPS columns then metric keys as columns."""
        steps = self.steps(run_id)
        metrics = self.metrics(run_id)
        if metrics.empty:
            return steps
        wide = metrics.pivot_table(index="step", columns="key", values="value", aggfunc="last", dropna=False)
        wide = wide[[c for c in wide.columns if c not in steps.columns]]
        wide.columns.name = None
        out = steps.merge(wide.reset_index(), on="step", how="outer")
        return out.sort_values("step").reset_index(drop=True)

    def samples(self, run_id: str, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        where, params = ["TRUE"], []
        if step is not None:
            where.append("step = ?")
            params.append(int(step))
        if rank is not None:
            where.append("rank = ?")
            params.append(int(rank))
        return self._run_query(run_id, "samples", "SELECT * FROM {src} WHERE " + " AND ".join(where)
                               + " ORDER BY step, rank, sample_idx", params)

    def tokens(self, run_id: str, step: int, sample_idx: int | None = None, rank: int | None = None) -> pd.DataFrame:
        where, params = ["step = ?"], [int(step)]
        if sample_idx is not None:
            where.append("sample_idx = ?")
            params.append(int(sample_idx))
        if rank is not None:
            where.append("rank = ?")
            params.append(int(rank))
        return self._run_query(run_id, "tokens", "SELECT * FROM {src} WHERE " + " AND ".join(where)
                               + " ORDER BY rank, sample_idx, position", params)

    def token_steps(self, run_id: str) -> list[int]:
        """The steps with token rows, sorted. Read from the manifests' per-segment step lists (no Parquet is
        opened); segments whose entry has none (written before entries had them) are read with a DISTINCT."""

        def go() -> list[int]:
            st = self._state(run_id)
            files = st.files["tokens"]

            def listed() -> list[int]:
                steps: set[int] = set()
                unlisted = []
                for f in files:
                    runs = st.segment_steps.get(f)
                    if runs is None:
                        unlisted.append(f)
                    else:
                        steps.update(stepset.expand(runs))
                if unlisted:
                    self._ensure(unlisted)
                    rel = self._relation("tokens", unlisted)
                    steps.update(int(s) for (s,) in rel.aggregate("step", "step").fetchall())
                return sorted(steps)

            return self._cached(("token_steps", tuple(files)), listed)

        return self._retry(go)

    def token_counts(self, run_id: str) -> pd.DataFrame:
        """step, n: how many token rows each token-logged step of the run holds (all ranks)."""
        return self._run_query(run_id, "tokens", "SELECT step, count(*) AS n FROM {src} GROUP BY step ORDER BY step")

    def alerts(self, run_id: str) -> pd.DataFrame:
        return self._run_query(run_id, "alerts", "SELECT * FROM {src} ORDER BY step")

    def detector_state(self, run_id: str) -> pd.DataFrame:
        """The detector's checkpoints of the run (written online by RunLogger) and the dashboard's cache of a full
        replay (`detector_cache`), by lineage and seq: what `lld_monitor.detect.checkpoint.resume` reads."""
        own = self._run_query(run_id, "detector_state", "SELECT * FROM {src} ORDER BY lineage, seq, step")
        cached = []
        for f in detector_cache.cache_files(layout.run_dir(self.path, run_id)):
            try:  # one small file; a damaged one is skipped (the detector then replays), never an error
                cached.append(conform(pq.read_table(f), schema.DETECTOR_STATE).to_pandas())
            except (OSError, pa.ArrowException) as e:
                log.warning("run %s: detector cache %s unreadable (%s); ignored", run_id, Path(f).name, e)
        if not cached:
            return own
        return pd.concat([own, *cached] if len(own) else cached, ignore_index=True)

    def sql(self, query: str, params: list | None = None) -> pd.DataFrame:
        """Run read-only SQL over views runs, steps, metrics, samples, tokens, alerts (all runs). Use ? params."""

        # (re)build only the views the query names; a view left from an earlier query is harmless
        used = {t for t in (*layout.DATA_TABLES, "runs") if re.search(rf"\b{t}\b", query, re.IGNORECASE)}

        def go() -> pd.DataFrame:
            states = self._states()
            for t in layout.DATA_TABLES:
                if t in used or t not in self._views:
                    self._ensure([f for s in states.values() for f in s.files[t]])
                    self._relation(t, [f for s in states.values() for f in s.files[t]]).create_view(t, replace=True)
                    self._views.add(t)
            if "runs" in used or "runs" not in self._views:
                runs_df = self._runs_frame(states, self._step_counts(states))
                self._con.register("_runs_df", runs_df)
                self._con.execute("CREATE OR REPLACE VIEW runs AS SELECT * FROM _runs_df")
                self._views.add("runs")
            return self._con.execute(query, params or []).df()

        return self._retry(go)

    def close(self) -> None:
        with self._lock:
            self._con.close()

    def __enter__(self) -> "StoreReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_store_reader(path: str | os.PathLike, **kwargs: Any) -> StoreReader:
    """Open a store for reading (NotAStoreError / NewerSchemaError with a clear message if it is not one)."""
    return StoreReader(path, **kwargs)
