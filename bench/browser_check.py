"""Load dashboard pages in headless Chromium (Playwright driving /usr/bin/chromium) and check they rendered.

Used by tests/test_browser_dashboard.py and bench/dashboard_queries.py. Never downloads a browser.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
    "--no-first-run", "--disable-component-update", "--disable-sync",
]
PAGES = {"live": "live", "compare": "compare", "tokens": "tokens", "postmortem": "postmortem"}
SIZES = ((1280, 800), (1920, 1080))  # the screens every page is checked at
COLOURED_TOKENS = '.lld-tokens span[style*="background:hsl"]'  # scored tokens, coloured by probability or Δ
BAND_LABELS = '[data-testid="stPlotlyChart"] .annotation-text'  # phase band labels (and panel titles)
APP_IDLE = '[data-testid="stApp"][data-test-script-state="notRunning"]'
CHART = '[data-testid="stPlotlyChart"] .main-svg'
EXCEPTION = '[data-testid="stException"]'


@dataclass
class PageResult:
    name: str
    url: str
    charts: int
    exceptions: int
    seconds: float
    screenshot: str | None = None
    texts: list[str] = field(default_factory=list)


def launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def load_page(page, url: str, timeout_ms: int = 60_000, want_chart: bool = True) -> tuple[int, int]:
    """Navigate, wait until the script finished and (if wanted) a Plotly chart drew its SVG."""
    page.goto(url, wait_until="domcontentloaded", timeout=timeout_ms)
    page.wait_for_selector(APP_IDLE, timeout=timeout_ms)
    if want_chart:
        try:
            page.wait_for_selector(CHART, timeout=timeout_ms)
        except Exception as exc:
            raise RuntimeError(f"no Plotly chart drawn at {url}: {diagnose(page)}") from exc
    page.wait_for_timeout(300)  # let late elements of the same run land
    page.wait_for_selector(APP_IDLE, timeout=timeout_ms)
    return page.locator('[data-testid="stPlotlyChart"]').count(), page.locator(EXCEPTION).count()


def diagnose(page) -> str:
    """What the page shows right now (for a failure message)."""
    app = page.locator('[data-testid="stApp"]')
    state = app.get_attribute("data-test-script-state") if app.count() else "no stApp"
    svgs = page.locator(CHART)
    return (f"url={page.url} script={state} charts={page.locator('[data-testid=stPlotlyChart]').count()} "
            f"svgs={svgs.count()} visible={[svgs.nth(i).is_visible() for i in range(min(svgs.count(), 5))]} "
            f"exceptions={page.locator(EXCEPTION).all_inner_texts()[:2]} "
            f"text={page.locator('[data-testid=stMain]').inner_text()[:300]!r}")


def check_pages(base_url: str, shot_dir: str | Path | None = None, pages: dict[str, str] | None = None,
                query: str = "", timeout_ms: int = 60_000, height: int = 1000) -> list[PageResult]:
    from playwright.sync_api import sync_playwright

    results = []
    with sync_playwright() as p:
        browser = launch(p)
        try:
            ctx = browser.new_context(viewport={"width": 1400, "height": height})
            page = ctx.new_page()
            for name, path in (pages or PAGES).items():
                url = f"{base_url.rstrip('/')}/{path}{query}"
                t0 = time.perf_counter()
                charts, exc = load_page(page, url, timeout_ms)
                dt = time.perf_counter() - t0
                shot = None
                if shot_dir is not None:
                    shot = str(Path(shot_dir) / f"{name}.png")
                    page.screenshot(path=shot, full_page=True)
                texts = page.locator(EXCEPTION).all_inner_texts() if exc else []
                results.append(PageResult(name, url, charts, exc, dt, shot, texts))
        finally:
            browser.close()
    return results


def screenshot_pages(base_url: str, shot_dir: str | Path, query: str = "", sizes=SIZES, prefix: str = "",
                     full_height: int | None = None, timeout_ms: int = 60_000) -> dict[str, dict]:
    """Every page at every screen size: a PNG each (`{prefix}{page}-{w}x{h}.png`) and what is on screen:
    charts, exceptions, coloured tokens, band shapes, annotation texts, the URL after load and whether
    Streamlit showed its "Page not found" dialog. `full_height`: also one tall shot per page (whole page)."""
    from playwright.sync_api import sync_playwright

    out: dict[str, dict] = {}
    shot_dir = Path(shot_dir)
    shot_dir.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = launch(p)
        try:
            views = [(w, h, f"{w}x{h}") for w, h in sizes]
            if full_height:
                views.append((sizes[0][0], full_height, "full"))
            for w, h, tag in views:
                page = browser.new_page(viewport={"width": w, "height": h})
                for name, path in PAGES.items():
                    url = f"{base_url.rstrip('/')}/{path}{query}"
                    charts, exc = load_page(page, url, timeout_ms)
                    page.wait_for_timeout(700)  # Plotly's transitions and late fragments settle
                    shot = shot_dir / f"{prefix}{name}-{tag}.png"
                    page.screenshot(path=str(shot))
                    out[f"{name}-{tag}"] = {
                        "url": page.url, "screenshot": str(shot), "charts": charts, "exceptions": exc,
                        "coloured_tokens": page.locator(COLOURED_TOKENS).count(),
                        "band_shapes": page.locator('[data-testid="stPlotlyChart"] .shapelayer path').count(),
                        "annotations": page.locator(BAND_LABELS).all_text_contents(),  # SVG text: no innerText
                        "not_found": page.get_by_text("Page not found").count(),
                        "texts": page.locator(EXCEPTION).all_inner_texts() if exc else [],
                    }
                page.close()
        finally:
            browser.close()
    return out


def time_to_first_chart(base_url: str, server_started: float, timeout_s: float = 120.0) -> float:
    """Seconds from `server_started` (time.perf_counter() when the serve process was started) until the
    first Plotly chart is drawn in Chromium; retries the page load until the server answers."""
    from playwright.sync_api import Error as PwError
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            deadline = server_started + timeout_s
            while True:
                try:
                    page.goto(base_url, wait_until="domcontentloaded", timeout=5_000)
                    break
                except PwError:
                    if time.perf_counter() > deadline:
                        raise
                    time.sleep(0.1)
            try:
                page.wait_for_selector(CHART, timeout=timeout_s * 1000)
            except Exception as exc:
                raise RuntimeError(f"no Plotly chart drawn at {base_url}: {diagnose(page)}") from exc
            return time.perf_counter() - server_started
        finally:
            browser.close()
