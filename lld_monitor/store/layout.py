"""Where things live inside a store folder, and the small atomic-JSON helpers both sides use.

```
<store>/store.json                        {"format": "lld-monitor-store", "schema_version": 2}
<store>/runs/<run_id>/run.json            the runs-table row (written by rank 0; a placeholder by any rank)
<store>/runs/<run_id>/manifest-r<R>.json  rank R's writer (pid, host, heartbeat, status) + live segments (file,
                                          level, rows, schema fingerprint, steps as stepset runs)
<store>/runs/<run_id>/<table>/r<R>-<seq>-L<level>.parquet   append-only Parquet segments (temp name + os.replace)
<store>/runs/<run_id>/detector_cache/<config>.parquet   a dashboard's full detector replay of a run with no usable
                                          checkpoint (imported / old runs), one detector_state row (store/detector_cache.py)
```
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import secrets
import tempfile
from pathlib import Path
from typing import Any

from lld_monitor.files import atomic_write_text

STORE_FILE = "store.json"
STORE_FORMAT = "lld-monitor-store"
RUNS_DIR = "runs"
RUN_FILE = "run.json"
MANIFEST_PREFIX = "manifest-r"
DETECTOR_CACHE_DIR = "detector_cache"
DATA_TABLES = ("steps", "metrics", "samples", "tokens", "alerts", "detector_state")

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def iso(ts: _dt.datetime | None) -> str | None:
    return None if ts is None else ts.astimezone(_dt.timezone.utc).isoformat()


def parse_iso(text: str | None) -> _dt.datetime | None:
    if not text:
        return None
    ts = _dt.datetime.fromisoformat(text)
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=_dt.timezone.utc)
    return ts


def valid_run_id(run_id: str) -> bool:
    return bool(_RUN_ID_RE.match(run_id)) and run_id not in (".", "..")


def new_run_id(name: str) -> str:
    """A filesystem-safe, sortable id derived from the (free-text) run name."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()[:40] or "run"
    return f"{slug}-{utcnow().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def run_dir(store: Path, run_id: str) -> Path:
    return store / RUNS_DIR / run_id


def manifest_path(store: Path, run_id: str, rank: int) -> Path:
    return run_dir(store, run_id) / f"{MANIFEST_PREFIX}{rank}.json"


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (_dt.datetime, _dt.date)):
        return obj.isoformat()
    return str(obj)


def dumps(obj: Any) -> str:
    """JSON text; NaN/inf are kept (Python's JSON extension), odd objects become strings."""
    return json.dumps(obj, default=_json_default, ensure_ascii=False, allow_nan=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write to a temp file in the same folder, then os.replace: readers see the old or the new file, never half."""
    atomic_write_text(path, dumps(obj))


def create_json_exclusive(path: Path, obj: Any) -> bool:
    """Create `path` with `obj` only if it does not exist yet (atomic: temp file + os.link). True if created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dumps(obj))
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:
        os.unlink(tmp)


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def finite_or_none(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isfinite(x) else None
