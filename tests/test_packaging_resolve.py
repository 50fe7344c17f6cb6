"""`pip install 'lld-monitor[verl]'` resolves into an environment holding verl 0.9.1's pins (issue 29, item 3).

verl users install us into *their* environment: verl 0.9.1 asks for transformers<5.11 and its vllm / sglang / fsdp
extras pin torch==2.11.0 and transformers==5.9.0. pip's resolver, run for real against the package index
(`--dry-run --ignore-installed --report`, nothing installed), must find a set with those pins. Our earlier floors
(transformers>=5.24, torch>=2.13 in the base install) made this ResolutionImpossible.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
VERL_PINS = {"verl": "0.9.1", "transformers": "5.9.0", "torch": "2.11.0"}  # verl[vllm]'s torch / transformers
NETWORK_ERRORS = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                  "Network is unreachable", "ConnectTimeoutError", "ReadTimeoutError", "ProxyError")


def _build_flags() -> list[str]:
    """Build our metadata with the venv's setuptools when it is new enough (pyproject asks >= 68): saves fetching
    a build environment from the index."""
    try:
        major = int(metadata.version("setuptools").split(".")[0])
    except metadata.PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if major >= 68 else []


def _resolve(tmp_path: Path, requirement: str, pins: dict[str, str]) -> dict:
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("".join(f"{k}=={v}\n" for k, v in pins.items()))
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
           str(report), "-c", str(constraints), *_build_flags(), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and any(e in out for e in NETWORK_ERRORS):
        pytest.skip(f"the package index is unreachable from here, so pip cannot resolve: {out[-600:]}")
    assert proc.returncode == 0, f"pip could not resolve {requirement} with {pins}:\n{out[-4000:]}"
    return json.loads(report.read_text())


@pytest.mark.slow
def test_verl_extra_resolves_beside_verls_pins(tmp_path):
    report = _resolve(tmp_path, f"{ROOT}[verl]", VERL_PINS)
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
    for name, version in VERL_PINS.items():
        assert got.get(name) == version, (name, got.get(name))
    assert "lld-monitor" in got and "ray" in got
    ours = next(i for i in report["install"] if i["metadata"]["name"].lower() == "lld-monitor")
    base = {Requirement(r).name.lower() for r in ours["metadata"].get("requires_dist", []) if "extra ==" not in r}
    # the base install is the library: no transformers / dashboard pins of its own
    assert not base & {"transformers", "tokenizers", "streamlit", "plotly", "bm25s"}, base
