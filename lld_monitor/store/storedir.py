"""Opening a store: validate it (reader and writer), create and migrate it (writer only). A folder, or a prefix in a
bucket (`inspect_bucket_store`, `open_bucket_store_for_write`: store.json is created with a create-only PUT)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from . import layout, migrations
from .errors import NotAStoreError, StoreError
from .schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from .bucket import Bucket


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


def inspect_bucket_store(bucket: "Bucket") -> int | None:
    """Validate a store in a bucket for reading. Returns its schema_version; None = nothing under the prefix yet (an
    empty store). NotAStoreError for a prefix that holds other objects or a corrupt store.json; StoreError for a
    missing bucket or refused credentials (naming the variable to set)."""
    return read_bucket_store(bucket)[0]


def read_bucket_store(bucket: "Bucket") -> tuple[int | None, bytes | None]:
    """`inspect_bucket_store`, plus the store.json bytes it read (None with no store yet): the mirror keeps them
    instead of asking for the object a second time (one round trip less when a reader opens a bucket)."""
    try:
        data, _ = bucket.get(layout.STORE_FILE)
    except FileNotFoundError:
        problem = _not_a_bucket_store(bucket)
        if problem is None:
            return None, None
        # look again: a writer creating this store at the same moment puts store.json first, then its runs, so what
        # the LIST saw may be that store appearing, not a foreign prefix (two torchrun ranks on a new prefix)
        try:
            data, _ = bucket.get(layout.STORE_FILE)
        except FileNotFoundError:
            raise NotAStoreError(problem) from None
    try:
        meta = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NotAStoreError(f"{bucket.url}/{layout.STORE_FILE} is corrupt ({e}); this is not a readable lld-monitor "
                             "store.") from e
    return migrations.store_version(meta, bucket.url), data


def _not_a_bucket_store(bucket: "Bucket") -> str | None:
    """Why a prefix without store.json cannot be a new store (None: it is empty, a store may start there). Folder
    markers (a zero-byte object named like the prefix, "prefix/", as a console's "Create folder" makes and as SeaweedFS
    lists a directory it is creating) and hidden keys (the writers' conditional-write probes) do not count."""
    subs, objs = bucket.list_dir("")
    subs = [s for s in subs if s]
    others = [o.key for o in objs
              if o.key and not o.key.endswith("/") and not o.key.rsplit("/", 1)[-1].startswith(".")] + subs
    if layout.RUNS_DIR in subs:
        return (f"{bucket.url} holds runs/ but no {layout.STORE_FILE} (lost?). If it is an lld-monitor store, put back "
                f'{layout.STORE_FILE} = {{"format": "{layout.STORE_FORMAT}", "schema_version": {SCHEMA_VERSION}}}; '
                "nothing was changed.")
    if others:
        return (f"{bucket.url} is not an lld-monitor store (no {layout.STORE_FILE}, and the prefix holds other objects: "
                f"{', '.join(sorted(others)[:3])}). Pass --store with a store prefix, or a new/empty one.")
    return None


def open_bucket_store_for_write(bucket: "Bucket") -> None:
    """Create the store under the bucket prefix if there is none (store.json by a create-only PUT, so two writers
    starting at once agree), after checking that the server honours conditional writes."""
    version = inspect_bucket_store(bucket)
    bucket.check_conditional_writes()
    if version is None:
        from .bucket import ObjectExists

        try:
            bucket.put(layout.STORE_FILE, layout.dumps({"format": layout.STORE_FORMAT,
                                                         "schema_version": SCHEMA_VERSION}).encode(), create=True)
        except ObjectExists:
            pass  # another writer created it first: validate what is there
        version = inspect_bucket_store(bucket)
    if version is not None and version < SCHEMA_VERSION:
        raise StoreError(f"{bucket.url} has schema_version {version}; stores in a bucket start at "
                         f"{SCHEMA_VERSION} and are not migrated in place. Copy it to a folder, open it there with "
                         "this version (that migrates it), and copy it back.")
