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
