"""Shared pieces of the benchmarks: the figure row, timing helpers and a machine description.

Every figure is "ours vs a baseline measured in the same run", as medians of several repetitions,
because these machines are noisy: absolute seconds drift between runs, ratios taken side by side do not.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from lld_monitor.backend.numerics import cpu_model


@dataclass
class Figure:
    """One row of the bench table."""

    group: str  # e.g. "logging", "ingest", "queries", "end-to-end"
    name: str  # what was measured
    ours: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    goal: str = ""  # e.g. "ratio >= 5"
    met: bool | None = None  # whether the goal is met, when a goal is stated
    reps: int = 0
    higher_is_better: bool = False  # rows/s: True; seconds, bytes: False
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """How many times better ours is than the baseline (> 1: ours wins), whichever way "better" points."""
        if self.baseline is None or not self.ours or not self.baseline:
            return None
        return self.ours / self.baseline if self.higher_is_better else self.baseline / self.ours

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))])


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dir_bytes(path: str | os.PathLike) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def machine() -> dict:
    """What the figures were measured on."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    info["cpu_model"] = cpu_model()
    try:
        info["loadavg_at_start"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a dashboard server under test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_revision(rev: str, dest: Path, repo: Path | None = None) -> Path:
    """`git archive` of `rev` unpacked into `dest` (reused when it is there): the code a `--baseline REV` runs."""
    if not dest.exists():
        dest.mkdir(parents=True)
        cwd = repo or Path(__file__).resolve().parents[1]
        archive = subprocess.run(["git", "archive", rev], cwd=cwd, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest
