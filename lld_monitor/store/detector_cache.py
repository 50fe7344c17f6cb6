"""The detector cache beside a run: one `detector_state` row written after a full detector replay.

Runs written by RunLogger carry the online detector's checkpoints in their `detector_state` table. Runs that do
not (W&B imports, runs of older versions, runs logged with `detector=False`) need a full replay the first time
they are opened; the dashboard then stores that replay's result here, so the next reader (another session,
another server, a colleague) restores it instead of replaying again:

    <store>/runs/<run_id>/detector_cache/<config fingerprint>.parquet

This is the only file a dashboard process ever adds to a store. It never changes or removes anything else: the
file is new (temp name + os.replace), a failure to write it (a read-only store) is logged and ignored, and a
cache that no longer matches the run (the run grew, was re-imported, another detector config) fails the
checkpoint's digest check and is simply not used (lld_monitor/detect/checkpoint.py). `StoreReader.detector_state`
returns these rows with the run's own checkpoints.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lld_monitor.files import atomic_write

from . import layout, schema
from .convert import to_table
from .errors import StoreError
from .location import is_bucket

log = logging.getLogger(__name__)

_CONFIG_RE = re.compile(r"^[0-9a-f]{1,64}$")


def cache_path(store: str | os.PathLike, run_id: str, config: str) -> Path:
    """Where the cache of `run_id` for detector config fingerprint `config` lives."""
    if not layout.valid_run_id(run_id):
        raise StoreError(f"run_id {run_id!r} is not filesystem-safe")
    if not _CONFIG_RE.match(str(config)):
        raise StoreError(f"detector config fingerprint {config!r} is not a hex string")
    return layout.run_dir(Path(store), run_id) / layout.DETECTOR_CACHE_DIR / f"{config}.parquet"


def write_detector_cache(store: str | os.PathLike, run_id: str, row: Mapping[str, list]) -> Path | str | None:
    """Store one `detector_state` row (without run_id; one-row columns) as the run's detector cache. Returns its
    path (its URL in a bucket: a create-only PUT), or None when it could not be written (logged; a read-only store
    is not an error)."""
    config = row.get("config")
    config = str(config[0] if isinstance(config, list) and config else config)
    if is_bucket(store):
        return _write_to_bucket(str(store), run_id, config, row)
    path = cache_path(store, run_id, config)
    if not path.parent.parent.is_dir():
        log.info("detector cache not written: run folder %s is gone", path.parent.parent)
        return None
    table = to_table("detector_state", dict(row), schema.DETECTOR_STATE, force={"run_id": run_id})
    if table.num_rows != 1:
        raise StoreError(f"a detector cache holds one row, got {table.num_rows}")
    try:
        atomic_write(path, lambda tmp: pq.write_table(table, tmp))
    except OSError as exc:
        log.info("detector cache for run %s not written (%s); it is recomputed next time", run_id, exc)
        return None
    log.info("detector cache written for run %s at step %s", run_id, table.column("step")[0].as_py())
    return path


def _write_to_bucket(url: str, run_id: str, config: str, row: Mapping[str, list]) -> str | None:
    from .bucket import Bucket, ObjectExists

    rel = cache_path("/", run_id, config).relative_to("/").as_posix()
    table = to_table("detector_state", dict(row), schema.DETECTOR_STATE, force={"run_id": run_id})
    if table.num_rows != 1:
        raise StoreError(f"a detector cache holds one row, got {table.num_rows}")
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    try:
        Bucket(url).put(rel, sink.getvalue().to_pybytes(), create=True)
    except ObjectExists:
        pass  # another reader cached the same replay first
    except StoreError as exc:
        log.info("detector cache for run %s not written to %s (%s); it is recomputed next time", run_id, url, exc)
        return None
    log.info("detector cache written for run %s at step %s into %s", run_id, table.column("step")[0].as_py(), url)
    return f"{url}/{rel}"


def cache_files(run_dir: Path) -> list[str]:
    """The run's detector cache files (none for most runs)."""
    d = run_dir / layout.DETECTOR_CACHE_DIR
    if not d.is_dir():
        return []
    return sorted(str(p) for p in d.glob("*.parquet"))
