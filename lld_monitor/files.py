"""Files on disk: the user cache folder, an inter-process lock, and writes a reader never sees half of.

A leaf module (standard library only): the store, the trainer's kernels and warm starts, and the derived
caches all use it, and it imports none of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def user_cache_dir() -> Path:
    """`$LLD_MONITOR_CACHE`, else ~/.cache/lld-monitor: built kernels, trained warm starts."""
    base = os.environ.get("LLD_MONITOR_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "lld-monitor"


def atomic_write(path: Path, write: Callable[[str], None], suffix: str = ".tmp") -> None:
    """`write(tmp)` a temp file in `path`'s folder, then rename it onto `path`: a reader sees the old file or
    the new one, never half of one. The temp file is removed if anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """An inter-process lock on `path` (flock; a no-op where fcntl does not exist). Logs when it must wait."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process holds %s; waiting for it", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
