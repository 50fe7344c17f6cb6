"""`ruff check` (rules in pyproject.toml: F and I at least) is part of the suite: a finding fails it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -r requirements.txt (it is pinned there)")
    return [found]


def test_ruff_check_is_clean():
    proc = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix`):\n{proc.stdout}{proc.stderr}"


def test_ruff_config_selects_pyflakes_and_isort():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert {"F", "I"} <= set(cfg["select"])
