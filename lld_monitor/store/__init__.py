"""The run store: a folder of Parquet segments per run, read live through an in-memory DuckDB.

No torch here (the dashboard imports this). See docs/store.md for the layout and the numbers.
"""

from .errors import NewerSchemaError, NotAStoreError, RunNotFoundError, StoreError
from .reader import StoreReader, open_store_reader
from .schema import SCHEMA_VERSION
from .writer import RunWriter, WriterConfig


def default_store_path() -> str:
    """`$LLD_MONITOR_STORE`, else `./lld_runs`."""
    import os

    return os.environ.get("LLD_MONITOR_STORE") or "lld_runs"


__all__ = [
    "NewerSchemaError",
    "NotAStoreError",
    "RunNotFoundError",
    "RunWriter",
    "SCHEMA_VERSION",
    "StoreError",
    "StoreReader",
    "WriterConfig",
    "default_store_path",
    "open_store_reader",
]
