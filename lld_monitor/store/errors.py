"""Errors raised by the run store. Every message says what is wrong and what to do."""

from __future__ import annotations


class StoreError(Exception):
    """Anything the store refuses to do (bad arguments, conflicting runs, unreadable data)."""


class NotAStoreError(StoreError):
    """The path is not an lld-monitor store (a plain file, a foreign folder, a corrupt store.json)."""


class NewerSchemaError(StoreError):
    """The store was written by a newer lld-monitor (schema_version above what this version knows)."""


class RunNotFoundError(StoreError, KeyError):
    """No run with that id or name in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class WriterConflictError(StoreError):
    """Another writer took over this run and rank (in a bucket: the manifest changed under this writer's ETag)."""


class BucketUnavailable(StoreError):
    """The object store could not be reached (connection refused, timeout, 5xx after retries). Try again later."""
