"""Test-session set-up: the trainer's pinned numerics, chosen before anything imports torch.

ATen and MKL pick their kernels when torch loads, so a test that builds a `Trainer` in this process (pinned
numerics by default) needs the variables set first; processes the tests start inherit them.
"""

from lld_monitor.backend import numerics

numerics.pin_environment()
