"""Is the process that writes a run still alive? (pid + start time on this host, heartbeat elsewhere)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import psutil

#: a writer on another host whose heartbeat is older than this is taken as gone
DEFAULT_STALE_AFTER_S = 300.0
STALE_AFTER_ENV = "LLD_MONITOR_STALE_AFTER_S"  # the dashboard's and CLI's value, where set


def stale_after_s() -> float:
    """`$LLD_MONITOR_STALE_AFTER_S`, else DEFAULT_STALE_AFTER_S (300 s)."""
    try:
        return float(os.environ.get(STALE_AFTER_ENV) or DEFAULT_STALE_AFTER_S)
    except ValueError:
        return DEFAULT_STALE_AFTER_S


def this_host() -> str:
    return socket.gethostname()


def writer_identity() -> dict[str, Any]:
    pid = os.getpid()
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = None
    return {"pid": pid, "host": this_host(), "pid_started": started}


def writer_alive(info: dict[str, Any], heartbeat_age_s: float | None, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> bool:
    """True while the writer described by `info` (pid, host, pid_started) may still be writing."""
    pid = info.get("pid")
    if info.get("host") == this_host() and isinstance(pid, int):
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            started = info.get("pid_started")
            # a reused pid belongs to a process started later than our writer
            return started is None or abs(proc.create_time() - float(started)) < 1.0
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            pass  # cannot tell (permissions): fall back to the heartbeat
    return heartbeat_age_s is None or heartbeat_age_s < stale_after_s


class HeartbeatWatch:
    """How long ago each writer's heartbeat last changed, on this process's monotonic clock: the age of a heartbeat
    written on another host without comparing two hosts' clocks (a shared folder's reader uses it)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def age(self, key: str, beat: str, first_age: float = 0.0) -> float:
        """Seconds since `beat` (the heartbeat text under `key`) was first seen here, plus `first_age` for a key never
        seen before (what the folder's own clock says: its mtime's age)."""
        now = time.monotonic()
        with self._lock:
            hit = self._seen.get(key)
            if hit is None or hit[0] != beat:
                start = now - (first_age if hit is None else 0.0)
                self._seen[key] = (beat, start)
            else:
                start = hit[1]
        return now - start
