"""The dashboard path never imports torch or transformers (not even indirectly)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dashboard_runs_every_page_without_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from bench.synth_store import SynthConfig, write_run
        write_run({str(tmp_path / 's')!r}, SynthConfig(steps=30, token_every=5, flush_every=10))
        import lld_monitor.ui.figures, lld_monitor.ui.queries, lld_monitor.ui.widgets, lld_monitor.ui.tokens
        import lld_monitor.ui.pairing, lld_monitor.ui.phase_bands, lld_monitor.commands.serve, lld_monitor.commands.demo
        from streamlit.testing.v1 import AppTest
        at = AppTest.from_file({str(ROOT / 'app.py')!r}, default_timeout=90)
        at.session_state["store_path"] = {str(tmp_path / 's')!r}
        at.run()
        for page in ("pages/compare_runs.py", "pages/token_inspector.py", "pages/post_mortem.py"):
            at.switch_page(page).run()
            assert not at.exception, at.exception
        assert len(at.get("plotly_chart")) >= 1
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "trl", "accelerate"))
        print("HEAVY", bad)
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "HEAVY []" in r.stdout
