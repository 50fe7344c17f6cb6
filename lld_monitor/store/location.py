"""What a `--store` argument names: a local folder, or a prefix in a bucket (`s3://bucket/prefix`, `gs://`, `az://`).

Nothing here touches the network or imports the object-store client: commands and the dashboard call it to decide
which kind of store they were given, and to show or key it without `Path(...).resolve()` mangling a URL.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: URL schemes of object stores (the `s3` extra's client, obstore, speaks all three)
BUCKET_SCHEMES = ("s3", "gs", "az")
_URL_RE = re.compile(r"^(s3|s3a|gs|az|abfs|abfss|azure)://[^/]+", re.IGNORECASE)


def is_bucket(store: str | os.PathLike | None) -> bool:
    """True when `store` names a prefix in a bucket (`s3://...`, `gs://...`, `az://...`), not a folder."""
    return isinstance(store, str) and bool(_URL_RE.match(store.strip()))


def bucket_url(store: str) -> str:
    """The URL without surrounding blanks and trailing slashes (`s3://b/p/` and `s3://b/p` are one store)."""
    return store.strip().rstrip("/")


def canonical(store: str | os.PathLike) -> str:
    """One spelling per store: a bucket URL as given (trailing `/` dropped), a folder as its absolute path."""
    if is_bucket(store):
        return bucket_url(str(store))
    return str(Path(store).expanduser().resolve())


def exists_locally(store: str | os.PathLike) -> bool:
    """For a folder, whether it exists; a bucket is never judged from here (the reader says what is wrong)."""
    return is_bucket(store) or Path(store).expanduser().exists()
