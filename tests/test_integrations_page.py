"""The "Import from W&B" dashboard page (streamlit AppTest) and the torch-free import path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wandb_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wbp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true", WANDB_CONFIG_DIR=str(root / "cfg"),
               WANDB_CACHE_DIR=str(root / "cache"), WANDB_DATA_DIR=str(root / "data"), WANDB_CONSOLE="off")
    subprocess.run([sys.executable, str(ROOT / "tests" / "test_integrations_wandb_offline.py"), str(root)],
                   check=True, env=env, timeout=240, cwd=root)
    return root / "wandb"


PAGE_SCRIPT = r"""
import sys
from streamlit.testing.v1 import AppTest
store, folder = sys.argv[1], sys.argv[2]
at = AppTest.from_file("pages/import_wandb.py", default_timeout=60)
at.session_state["store_path"] = store
at.run()
assert not at.exception, at.exception
at.text_input(key="imp_off_path").input(folder)
at.button[0].click()   # the offline form's submit button
at.run()
assert not at.exception, at.exception
assert any("Imported 9 run(s)" in s.value for s in at.success), [s.value for s in at.success]
assert len(at.dataframe) == 1 and len(at.dataframe[0].value) == 9
# online form without an entity: a clear message, and no wandb.Api is ever constructed
import wandb
def _no_api(*a, **k):
    raise AssertionError("wandb.Api must not be constructed here")
wandb.Api = _no_api
at.button[1].click()
at.run()
assert any("Entity and project" in e.value for e in at.error), [e.value for e in at.error]
bad = [m for m in ("torch", "transformers", "trl") if m in sys.modules]
assert not bad, f"the import page pulled in {bad}"
print("PAGE-OK")
"""


def test_import_page_offline_and_no_torch(wandb_dir, tmp_path):
    store = tmp_path / "store"
    out = subprocess.run([sys.executable, "-c", PAGE_SCRIPT, str(store), str(wandb_dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "PAGE-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    from lld_monitor.store import open_store_reader

    with open_store_reader(store) as r:
        assert len(r.runs()) == 9 and set(r.runs()["source"]) == {"wandb"}


def test_import_modules_do_not_import_torch():
    code = ("import sys, lld_monitor.integrations.wandb.importer, lld_monitor.integrations.wandb.offline_file, "
            "lld_monitor.integrations.wandb.run_profile, lld_monitor.integrations.wandb.export, lld_monitor.commands.import_wandb; "
            "bad=[m for m in ('torch','transformers','trl') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
