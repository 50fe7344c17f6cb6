"""The run store: a folder of Parquet segments per run, read live through an in-memory DuckDB.

No torch here (the dashboard imports this). See docs/store.md for the layout and the numbers.
"""

import os
from pathlib import Path

from .errors import NewerSchemaError, NotAStoreError, RunNotFoundError, StoreError
from .reader import StoreReader, open_store_reader
from .schema import SCHEMA_VERSION
from .writer import RunWriter, WriterConfig

STORE_ENV = "LLD_MONITOR_STORE"  # where runs are written and read, for every command
DASHBOARD_STORE_ENV = "LLD_MONITOR_DASHBOARD_STORE"  # set by `lld-monitor serve --store` for the Streamlit app
DEFAULT_STORE = "lld_runs"
SAMPLE_RUNS = Path(__file__).resolve().parents[2] / "sample_runs"  # the bundled runs (a source checkout)


def default_store_path() -> str:
    """`$LLD_MONITOR_STORE`, else `./lld_runs`: where runs are written (train, demo, import) and read (runs, detect)."""
    return os.environ.get(STORE_ENV) or DEFAULT_STORE


def dashboard_store_path() -> str:
    """The store the dashboard opens: `$LLD_MONITOR_DASHBOARD_STORE` (set by `serve --store`), else
    `$LLD_MONITOR_STORE`, else the bundled sample_runs/ (so a fresh checkout shows real runs)."""
    env = os.environ.get(DASHBOARD_STORE_ENV) or os.environ.get(STORE_ENV)
    if env:
        return env
    return str(SAMPLE_RUNS) if SAMPLE_RUNS.exists() else DEFAULT_STORE


__all__ = [
    "NewerSchemaError",
    "NotAStoreError",
    "RunNotFoundError",
    "RunWriter",
    "SCHEMA_VERSION",
    "StoreError",
    "StoreReader",
    "WriterConfig",
    "DASHBOARD_STORE_ENV",
    "DEFAULT_STORE",
    "STORE_ENV",
    "dashboard_store_path",
    "default_store_path",
    "open_store_reader",
]
