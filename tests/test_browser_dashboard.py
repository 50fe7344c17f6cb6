"""Real browser: `lld-monitor serve` on a free port, every page loaded in headless Chromium (Playwright driving
/usr/bin/chromium), charts present, no Streamlit exception box, screenshots saved; the live page refreshes
itself while a writer appends steps."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _net import free_port

from bench import browser_check as bc  # noqa: E402
from bench.synth_store import write_pair  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(bc.CHROMIUM).exists(), reason="needs /usr/bin/chromium (apt-get install chromium)"),
]
MIN_CHARTS = {"live": 1, "compare": 1, "tokens": 2, "postmortem": 1}  # default run: the live one (no collapse yet)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    store = tmp_path_factory.mktemp("browser") / "store"
    write_pair(store, steps=60, token_every=5, flush_every=30)
    writer = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "synth_store.py"), str(store), "--single", "vanilla", "--name", "live-run",
         "--steps", "400", "--flush-every", "1", "--step-sleep", "0.3", "--token-every", "10"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "lld_monitor.cli", "serve", "--store", str(store), "--port", str(port)],
                             cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    from lld_monitor.commands.serve import wait_ready

    try:
        assert wait_ready("127.0.0.1", port, timeout=90, proc=serve), "lld-monitor serve did not come up"
        yield {"url": f"http://127.0.0.1:{port}", "port": port, "serve": serve, "store": store}
    finally:
        writer.kill()
        writer.wait()
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGINT)  # what Ctrl-C does
            try:
                serve.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()


@pytest.mark.timeout(300)
def test_every_page_renders_in_chromium(served, tmp_path):
    results = bc.check_pages(served["url"], tmp_path)
    assert [r.name for r in results] == list(bc.PAGES)
    for r in results:
        assert r.exceptions == 0, (r.name, r.texts)
        assert r.charts >= MIN_CHARTS[r.name], (r.name, r.charts)
        assert Path(r.screenshot).stat().st_size > 20_000, r.screenshot  # a real rendering, not a blank page


def _steps_logged(page) -> int:
    metric = page.locator('[data-testid="stMetric"]').filter(has_text="Steps logged")
    text = metric.locator('[data-testid="stMetricValue"]').inner_text()
    return int(re.sub(r"\D", "", text))


@pytest.mark.timeout(300)
def test_live_page_refreshes_itself_and_links_open_the_token_inspector(served, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = bc.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            bc.load_page(page, served["url"] + "/?run=" + _live_run_id(served["store"]))
            assert page.locator('[data-testid="stMetric"]').filter(has_text="live").count() == 1
            first = _steps_logged(page)
            counts = [first]
            for _ in range(10):  # no reload: the fragment's run_every timer redraws the page
                page.wait_for_timeout(1500)
                counts.append(_steps_logged(page))
                if counts[-1] >= first + 3:
                    break
            assert counts[-1] > first, counts
            assert page.locator(bc.EXCEPTION).count() == 0
            page.screenshot(path=str(tmp_path / "live-running.png"))
            # post-mortem -> top displaced sample link -> token inspector at that step
            bc.load_page(page, served["url"] + "/postmortem?run=" + _pair_run_id(served["store"], "synth-vanilla"))
            link = page.locator('[data-testid="stPageLink-NavLink"]').first
            href = link.get_attribute("href") or ""
            assert "step=" in href and "sample=" in href, href
            link.click()
            page.wait_for_selector(bc.APP_IDLE)
            page.wait_for_selector(bc.CHART)
            page.wait_for_timeout(500)
            assert "Token inspector" in page.locator("h1").first.inner_text()
            assert page.locator(".lld-tokens").count() == 1 and page.locator(bc.EXCEPTION).count() == 0
        finally:
            browser.close()


def _run_ids(store: Path) -> dict[str, str]:
    from lld_monitor.store import open_store_reader

    with open_store_reader(store) as r:
        runs = r.runs()
    return dict(zip(runs["name"], runs["run_id"]))


def _live_run_id(store: Path) -> str:
    return _run_ids(store)["live-run"]


def _pair_run_id(store: Path, name: str) -> str:
    return _run_ids(store)[name]


def _serve(store: Path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lld_monitor.cli", "serve", "--store", str(store), "--port", str(port)],
                            cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    from lld_monitor.commands.serve import wait_ready

    assert wait_ready("127.0.0.1", port, timeout=90, proc=proc), "lld-monitor serve did not come up"
    return proc, f"http://127.0.0.1:{port}"


def _check_story(shots: dict, where: str) -> None:
    """What a newcomer must see on every page and screen size."""
    from lld_monitor.ui.phase_bands import phase_short

    for key, r in shots.items():
        assert r["exceptions"] == 0 and r["not_found"] == 0, (where, key, r["texts"], r["url"])
        assert "run=" in r["url"], (where, key, r["url"])  # every page's URL keeps the run
        assert Path(r["screenshot"]).stat().st_size > 20_000, r["screenshot"]
        page = key.split("-")[0]
        if page == "tokens":  # the token inspector opens on a sample with coloured tokens, never an empty box
            assert r["coloured_tokens"] >= 5, (where, key, r["coloured_tokens"])
        if page == "live":  # the phase bands are drawn and labelled
            assert r["band_shapes"] >= 6, (where, key, r["band_shapes"])
            labels = {phase_short(p) for p in ("healthy", "stagnation", "decay", "collapse", "acceleration")}
            texts = {str(t).strip() for t in r["annotations"] if t}
            assert labels & texts, (where, key, sorted(texts))


@pytest.mark.timeout(600)
def test_screenshots_of_every_page_on_sample_runs_and_on_a_live_store(served, tmp_path):
    """Every page at 1280x800 and 1920x1080 (PNG under tmp_path), on the bundled sample runs (opened on the
    collapsing vanilla run) and on the live store that a writer is filling."""
    sample = ROOT / "sample_runs"
    if not (sample / "store.json").exists():
        pytest.skip("no sample_runs/ in this checkout")
    import shutil

    store = tmp_path / "sample_store"
    shutil.copytree(sample, store)  # sample_runs/ may be regenerated while the test runs
    proc, url = _serve(store)
    try:
        shots = bc.screenshot_pages(url, tmp_path / "sample_runs", full_height=2000)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(20)
    _check_story(shots, "sample_runs")
    live = bc.screenshot_pages(served["url"], tmp_path / "live", query="?run=" + _live_run_id(served["store"]),
                               prefix="live-store-")
    _check_story({k: v for k, v in live.items() if not k.startswith("tokens")}, "live store")
    # the live run's token data may start only a few steps in: the inspector shows tokens once it has any
    assert all(v["exceptions"] == 0 for v in live.values())


def test_ctrl_c_stops_serve_and_its_server(served):
    # runs last in this module: SIGINT to `lld-monitor serve` (as Ctrl-C) stops Streamlit and frees the port
    serve = served["serve"]
    os.killpg(serve.pid, signal.SIGINT)
    assert serve.wait(20) == 0
    deadline = time.monotonic() + 10
    while _port_open(served["port"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _port_open(served["port"])
