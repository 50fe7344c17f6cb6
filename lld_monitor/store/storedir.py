"""Opening a store folder: validate it (reader and writer), create and migrate it (writer only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import layout, migrations
from .errors import NotAStoreError, StoreError
from .schema import SCHEMA_VERSION


def inspect_store(path: str | os.PathLike) -> tuple[Path, int | None]:
    """Validate a store for reading. Returns (path, schema_version); version None = empty folder (no runs yet).

    Raises NotAStoreError for a missing path, a plain file, a foreign folder or a corrupt store.json;
    NewerSchemaError for a store written by a newer lld-monitor.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise NotAStoreError(
            f"No store at {p}: the folder does not exist. Log a run there first (RunLogger / lld-monitor train) "
            "or pass --store with an existing store folder."
        )
    if not p.is_dir():
        raise NotAStoreError(
            f"{p} is a file, not an lld-monitor store. A store is a folder holding {layout.STORE_FILE}; "
            "pass --store with that folder."
        )
    meta_path = p / layout.STORE_FILE
    if not meta_path.exists():
        problem = _not_a_store(p)
        # look again: a process creating this store writes store.json first (atomically), then runs/ and the
        # runs, so what the scan saw may be that store appearing, not a foreign folder
        if not meta_path.exists():
            if problem:
                raise NotAStoreError(problem)
            return p, None
    try:
        meta = layout.read_json(meta_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NotAStoreError(f"{meta_path} is corrupt ({e}); this is not a readable lld-monitor store.") from e
    return p, migrations.store_version(meta, p)


def _not_a_store(p: Path) -> str | None:
    """Why a folder without store.json cannot be a new store (None: it is empty, a store may start there)."""
    if (p / layout.RUNS_DIR).is_dir() and any((p / layout.RUNS_DIR).glob(f"*/{layout.RUN_FILE}")):
        return (f"{p} holds run folders but no {layout.STORE_FILE} (lost?). If it is an lld-monitor store, recreate "
                f'{p / layout.STORE_FILE} with {{"format": "{layout.STORE_FORMAT}", "schema_version": {SCHEMA_VERSION}}}; '
                "nothing was changed.")
    if any(e for e in p.iterdir() if not e.name.startswith(".")):
        return (f"{p} is not an lld-monitor store (no {layout.STORE_FILE}, and the folder holds other files). "
                "Pass --store with a store folder, or an empty/new folder to start one.")
    return None


def open_store_for_write(path: str | os.PathLike) -> Path:
    """Create the store if the folder is missing or empty; migrate it if it is older. Returns its path."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise NotAStoreError(f"{p} is a file, not a store folder; nothing was written. Pick a folder path.")
    if p.is_dir():
        p, version = inspect_store(p)
    else:
        version = None
    if version is None:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the store folder {p}: {e}") from e
        layout.create_json_exclusive(
            p / layout.STORE_FILE, {"format": layout.STORE_FORMAT, "schema_version": SCHEMA_VERSION}
        )
        (p / layout.RUNS_DIR).mkdir(exist_ok=True)
        # another process may have created it first with an older version: validate what is there
        p, version = inspect_store(p)
    if version is not None and version < SCHEMA_VERSION:
        migrations.migrate_store(p)
    (p / layout.RUNS_DIR).mkdir(exist_ok=True)
    return p
