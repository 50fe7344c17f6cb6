"""`lld-monitor serve`: the Streamlit dashboard on a store (localhost unless told otherwise)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lld_monitor.detect.forecast_model import MODEL_ENV, ForecastModel
from lld_monitor.store import DASHBOARD_STORE_ENV, dashboard_store_path
from lld_monitor.store.location import canonical, exists_locally

log = logging.getLogger(__name__)

HELP = "serve the dashboard (live health, compare runs, token inspector, post-mortem) on a store"
APP = Path(__file__).resolve().parents[2] / "app.py"
STORE_ENV = DASHBOARD_STORE_ENV  # read by lld_monitor.store.dashboard_store_path in the app
OPEN_RUN_ENV = "LLD_MONITOR_DASHBOARD_RUN"  # the run the pages open on when the URL names none (ui.widgets)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None,
                   help="store to show: a folder or s3://bucket/prefix (AWS_* variables; default: $LLD_MONITOR_STORE, "
                   "else the bundled sample_runs/)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; anything else exposes the dashboard to the network)")
    p.add_argument("--port", type=int, default=8501, help="port (default 8501)")
    p.add_argument("--forecast-model", metavar="FILE",
                   help="collapse-forecast model from `lld-monitor forecast fit` for every run shown (default: "
                        "$LLD_MONITOR_FORECAST_MODEL, else the shipped ones)")


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def streamlit_command(host: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", host, "--server.port", str(port), "--server.headless", "true",
        "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
        "--global.developmentMode", "false", "--client.toolbarMode", "viewer",
    ]


def _die_with_parent() -> None:
    """In the Streamlit child (Linux): get SIGTERM when the process that started it dies, even by SIGKILL,
    so a killed `lld-monitor serve` leaves no orphan server holding the port and serving the runs."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_server(store: str | os.PathLike, host: str = "127.0.0.1", port: int = 8501,
                 quiet: bool = False, open_run: str | None = None,
                 forecast_model: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start the dashboard server as a child process (its own process group) showing `store`; `open_run` (a run
    name or id) is the run its pages open on when the URL names none (the demo: its live vanilla run);
    `forecast_model` a model file the pages forecast with instead of the shipped ones."""
    if not APP.exists():
        raise FileNotFoundError(f"the dashboard entry {APP} is missing; reinstall lld-monitor from its checkout")
    if not is_loopback(host):
        log.warning("binding the dashboard to %s: anyone who can reach this machine on port %d can read your runs. "
                    "Use --host 127.0.0.1 (the default) and an SSH tunnel unless this is what you want.", host, port)
    env = dict(os.environ)
    env[STORE_ENV] = canonical(store)  # a folder as its absolute path, a bucket URL as given
    if open_run:
        env[OPEN_RUN_ENV] = open_run
    if forecast_model:
        ForecastModel.load(forecast_model)  # a clear error now rather than on every page
        env[MODEL_ENV] = str(Path(forecast_model).expanduser().resolve())
    out = subprocess.DEVNULL if quiet else None
    return subprocess.Popen(streamlit_command(host, port), env=env, cwd=str(APP.parent), stdout=out, stderr=out,
                            start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def wait_ready(host: str, port: int, timeout: float = 60.0, proc: subprocess.Popen | None = None,
               warm: bool = True) -> bool:
    """Poll Streamlit's health endpoint until it answers (False on timeout or if `proc` exited); then, with
    `warm`, run the app once (`warm_up`) so the first visitor's link to a page opens without a detour."""
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{url_host}:{port}/_stcore/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - local health check
                if r.status == 200:
                    if warm:
                        warm_up(url_host, port, timeout=max(5.0, deadline - time.monotonic()))
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def warm_up(host: str, port: int, timeout: float = 60.0) -> bool:
    """One script run of the app through Streamlit's websocket, as a browser tab would start it.

    A freshly started server answers the *first* session that opens a page other than "/" (e.g. a bookmarked
    /tokens?run=..) with a "Page not found" dialog over the right page (streamlit/streamlit#9992): the page
    list is not known before the app's first run and its imports take seconds. After one run it is. Best
    effort: False (and a debug log) when it could not run."""
    import asyncio

    try:
        import websockets
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    except ImportError as exc:
        log.debug("no warm-up run: %s", exc)
        return False

    async def _run() -> bool:
        async with websockets.connect(f"ws://{host}:{port}/_stcore/stream", subprotocols=["streamlit"],
                                      max_size=None, open_timeout=10) as ws:
            msg = BackMsg()
            msg.rerun_script.query_string = ""
            msg.rerun_script.page_name = ""
            await ws.send(msg.SerializeToString())
            while True:
                fwd = ForwardMsg()
                fwd.ParseFromString(await ws.recv())
                if fwd.WhichOneof("type") == "script_finished":
                    return True

    try:
        return asyncio.run(asyncio.wait_for(_run(), timeout))
    except Exception as exc:  # noqa: BLE001 - a failed warm-up only costs the first visitor a dialog
        log.debug("warm-up run failed: %s", exc)
        return False


def stop_server(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the server's process group, then SIGKILL after `timeout`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(args: argparse.Namespace) -> int:
    store = args.store or dashboard_store_path()
    if not exists_locally(store):
        log.warning("no store at %s yet; the dashboard will say so until a run writes there", store)

    state = {"started": False, "pending": False}

    def _stop(signum, frame):  # SIGTERM behaves like Ctrl-C (installed even if the shell ignored SIGINT)
        if not state["started"]:
            # the server is being started: stop it as soon as it exists, so no orphan keeps the port
            state["pending"] = True
            return
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, _stop)
    old_int = signal.signal(signal.SIGINT, _stop)
    try:
        proc = start_server(store, args.host, args.port, forecast_model=args.forecast_model)
    except (FileNotFoundError, ValueError) as e:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        print(f"lld-monitor serve: --forecast-model: {e}", file=sys.stderr)
        return 2
    state["started"] = True
    try:
        if state["pending"]:
            raise KeyboardInterrupt
        if wait_ready(args.host, args.port, proc=proc):
            shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
            log.info("dashboard on http://%s:%d  (store: %s)  Ctrl-C stops it", shown, args.port, store)
        return proc.wait()
    except KeyboardInterrupt:
        log.info("stopping the dashboard")
        return 0
    finally:
        stop_server(proc)
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
