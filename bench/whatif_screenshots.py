"""The screenshots of issue 31's panels in docs/img/, made the way a user gets them (rerun to refresh them).

    .venv/bin/python bench/whatif_screenshots.py [--out docs/img] [--source sample_runs]

Copies the bundled runs to a temporary store (no cache in it), serves the dashboard on a free port, and in
headless Chromium (bench/browser_check.py: Playwright driving /usr/bin/chromium) opens each panel by its
toggle, as a user would: the dashboard starts `lld-monitor whatif` itself and draws the result when it is
done. Then it checks that each panel shows data (points on the chart, outlined tokens) and saves a PNG of it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import browser_check as bc  # noqa: E402
from bench.common import free_port  # noqa: E402

WIDTH, HEIGHT = 1400, 3200  # tall: Streamlit scrolls inside its own container, so the whole page must fit


def _run_ids(store: Path) -> dict[str, str]:
    from lld_monitor.store import open_store_reader

    with open_store_reader(store) as r:
        runs = r.runs()
    return {m: str(runs[runs["mode"] == m].iloc[0]["run_id"]) for m in ("vanilla", "llds") if (runs["mode"] == m).any()}


def _toggle(page, label: str) -> None:
    page.get_by_role("switch", name=label, exact=True).click(force=True)  # Streamlit's toggle: role switch


def _clip(page, top, bottom, pad: int = 12) -> dict:
    a, b = top.bounding_box(), bottom.bounding_box()
    main = page.locator('[data-testid="stMain"] [data-testid="stMainBlockContainer"]').bounding_box()
    y0, y1 = a["y"] - pad, b["y"] + b["height"] + pad
    return {"x": main["x"], "y": y0, "width": main["width"], "height": y1 - y0}


def shoot(url: str, ids: dict[str, str], out: Path, timeout_ms: int = 240_000) -> dict[str, dict]:
    from playwright.sync_api import sync_playwright

    res: dict[str, dict] = {}
    with sync_playwright() as p:
        browser = bc.launch(p)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            # Live health: the panel under the main chart
            bc.load_page(page, f"{url}/live?run={ids['vanilla']}", timeout_ms)
            _toggle(page, "LLDS would have applied")
            chart = page.locator('[data-testid="stPlotlyChart"]').filter(has_text="would have added")
            chart.wait_for(timeout=timeout_ms)
            page.wait_for_selector(bc.APP_IDLE, timeout=timeout_ms)
            page.wait_for_timeout(1500)
            points = chart.locator(".scatterlayer .point").count()
            cap = page.locator('[data-testid="stCaptionContainer"]').filter(has_text="would have acted on")
            shot = out / "whatif-live-health.png"
            page.screenshot(path=str(shot), clip=_clip(page, page.get_by_role("heading", name="LLDS would have applied"),
                                                       cap))
            res["live"] = {"png": str(shot), "points": points, "exceptions": page.locator(bc.EXCEPTION).count()}

            # Token inspector: the outline on the tokens LLDS would have penalised
            bc.load_page(page, f"{url}/tokens?run={ids['vanilla']}", timeout_ms)
            _toggle(page, "Outline the tokens LLDS would have penalised")
            page.locator(".lld-penalized").first.wait_for(timeout=timeout_ms)
            page.wait_for_selector(bc.APP_IDLE, timeout=timeout_ms)
            page.wait_for_timeout(800)
            top = page.get_by_role("switch", name="Outline the tokens LLDS would have penalised").locator("xpath=ancestor::label")
            shot = out / "whatif-token-inspector.png"
            page.screenshot(path=str(shot), clip=_clip(page, top, page.locator(".lld-tokens").first))
            res["tokens"] = {"png": str(shot), "outlined": page.locator(".lld-penalized").count(),
                             "exceptions": page.locator(bc.EXCEPTION).count()}

            # Compare runs: the vanilla run's counterfactual beside its LLDS twin's logged llds_loss
            bc.load_page(page, f"{url}/compare?run={ids['vanilla']}", timeout_ms)
            _toggle(page, "LLDS would have applied vs applied")
            chart = page.locator('[data-testid="stPlotlyChart"]').filter(has_text="what it would have applied")
            chart.wait_for(timeout=timeout_ms)
            deadline = time.monotonic() + timeout_ms / 1000
            while page.get_by_text("Computing what LLDS would have done").count() and time.monotonic() < deadline:
                page.wait_for_timeout(500)  # the twin's counterfactual is still being computed
            page.wait_for_selector(bc.APP_IDLE, timeout=timeout_ms)
            page.wait_for_timeout(1500)
            chart = page.locator('[data-testid="stPlotlyChart"]').filter(has_text="what it would have applied")
            cap = page.locator('[data-testid="stCaptionContainer"]').filter(has_text="Same term, measured")
            shot = out / "whatif-compare.png"
            page.screenshot(path=str(shot), clip=_clip(page, chart, cap))
            res["compare"] = {"png": str(shot), "traces": chart.locator(".scatterlayer .trace").count(),
                              "exceptions": page.locator(bc.EXCEPTION).count()}
        finally:
            browser.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--source", default=str(ROOT / "sample_runs"), help="store to copy (default: sample_runs/)")
    args = ap.parse_args(argv)
    from lld_monitor.commands.serve import wait_ready
    from lld_monitor.counterfactual.cache import DERIVED_DIR

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lld-whatif-shots-") as tmp:
        store = Path(tmp) / "store"
        shutil.copytree(args.source, store, ignore=shutil.ignore_patterns(DERIVED_DIR))
        ids = _run_ids(store)
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "lld_monitor.cli", "serve", "--store", str(store), "--port",
                                 str(port)], cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            if not wait_ready("127.0.0.1", port, timeout=120, proc=proc):
                print("lld-monitor serve did not come up", file=sys.stderr)
                return 1
            res = shoot(f"http://127.0.0.1:{port}", ids, out)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    ok = (res["live"]["points"] > 10 and res["tokens"]["outlined"] > 0 and res["compare"]["traces"] >= 2
          and not any(r["exceptions"] for r in res.values()))
    for k, r in res.items():
        print(k, r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
