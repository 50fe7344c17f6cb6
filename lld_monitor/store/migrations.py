"""Schema versions of a store and how to move between them.

A store's version lives in `store.json` (`schema_version`). This module knows every version up to
`schema.SCHEMA_VERSION`:

- **v0** (the pre-release layout): `store.json` had no `schema_version`; `run.json` had no
  `schema_version`, `world_size`, `updated_at` or `source` fields.
- **v1**: the layout in `layout.py`; every run record carries all `schema.RUNS` fields.
- **v2**: a new data table, `detector_state` (the online detector's checkpoints, `schema.DETECTOR_STATE`), and
  the `detector_cache/` folder of a run. Nothing existing changes: a v1 run simply has no checkpoints (the
  dashboard replays its detector once and caches the result beside it). Run records only get the new version.

Two ways to apply a migration:
- `upgrade_run_record(rec, from_version)`: pure, in memory. Readers use it, so a read-only reader can
  show an old store without writing to it.
- `migrate_store(path)`: a writer opening an old store rewrites its metadata files to the current
  version (each rewrite is temp file + os.replace; the original is kept beside it as `*.v<N>.bak`),
  then bumps `store.json` last, so an interrupted migration is simply redone.

Column additions inside Parquet segments need no rewrite: readers fill a column that a segment lacks
with NULL (see `reader.py`), so adding a column to `schema.py` is a compatible change.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import layout
from .errors import NewerSchemaError, NotAStoreError
from .schema import SCHEMA_VERSION

log = logging.getLogger(__name__)


def _v0_to_v1_run(rec: dict[str, Any]) -> dict[str, Any]:
    rec = dict(rec)
    rec.setdefault("source", "local")
    rec.setdefault("world_size", 1)
    rec.setdefault("updated_at", rec.get("ended_at") or rec.get("started_at"))
    rec["schema_version"] = 1
    return rec


def _v1_to_v2_run(rec: dict[str, Any]) -> dict[str, Any]:
    return {**rec, "schema_version": 2}  # v2 only adds a table: nothing in the record changes


# version N -> function turning a version-N run record into a version-(N+1) one
RUN_RECORD_MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {0: _v0_to_v1_run, 1: _v1_to_v2_run}


def store_version(meta: Any, where: Path | str) -> int:
    """Validate a parsed store.json and return its schema_version (raises with a clear message)."""
    if not isinstance(meta, dict) or meta.get("format") != layout.STORE_FORMAT:
        raise NotAStoreError(
            f"{where} is not an lld-monitor store (its {layout.STORE_FILE} has no "
            f'"format": "{layout.STORE_FORMAT}"). Point --store at a store folder, or at a new/empty folder.'
        )
    version = meta.get("schema_version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise NotAStoreError(f"{where}/{layout.STORE_FILE} has an invalid schema_version {version!r}.")
    if version > SCHEMA_VERSION:
        raise NewerSchemaError(
            f"The store at {where} has schema_version {version}, but this lld-monitor understands up to "
            f"{SCHEMA_VERSION}. Upgrade lld-monitor (pip install -U lld-monitor) to read it; "
            "nothing was changed."
        )
    return version


def upgrade_run_record(rec: dict[str, Any], from_version: int) -> dict[str, Any]:
    """The run record as the current version would have written it (pure; nothing is written)."""
    version = int(rec.get("schema_version", from_version) or from_version)
    while version < SCHEMA_VERSION:
        rec = RUN_RECORD_MIGRATIONS[version](rec)
        version += 1
    return rec


def migrate_store(path: Path) -> list[str]:
    """Rewrite an older store to the current schema_version, in place. Returns what was done."""
    meta = layout.read_json(path / layout.STORE_FILE)
    version = store_version(meta, path)
    done: list[str] = []
    if version == SCHEMA_VERSION:
        return done
    runs_root = path / layout.RUNS_DIR
    for run_json in sorted(runs_root.glob(f"*/{layout.RUN_FILE}")) if runs_root.is_dir() else []:
        rec = layout.read_json(run_json)
        new = upgrade_run_record(rec, version)
        if new != rec:
            backup = run_json.with_name(f"{layout.RUN_FILE}.v{version}.bak")
            if not backup.exists():
                shutil.copy2(run_json, backup)
            layout.write_json_atomic(run_json, new)
            done.append(f"{run_json.parent.name}: run.json v{version} -> v{SCHEMA_VERSION}")
    backup = path / f"{layout.STORE_FILE}.v{version}.bak"
    if not backup.exists():
        shutil.copy2(path / layout.STORE_FILE, backup)
    layout.write_json_atomic(path / layout.STORE_FILE, {**meta, "schema_version": SCHEMA_VERSION})
    done.append(f"store.json v{version} -> v{SCHEMA_VERSION}")
    log.info("migrated store %s from schema_version %d to %d (%d runs)", path, version, SCHEMA_VERSION, len(done) - 1)
    return done
