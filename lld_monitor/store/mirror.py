"""A local copy of a store in a bucket, kept in step by ETag; `StoreReader` reads it like any store folder.

DuckDB never talks to the bucket (it has no httpfs offline, and scanning Parquet over the network costs seconds).
The reader asks the mirror, before each query, for the objects that query needs:

- **sync()** (at most every `poll_s`, 1 s): the first one lists `runs/` recursively (one request per 1,000 objects,
  made beside the GET of store.json when the mirror opens); later ones, in one round, LIST `runs/` and each run that
  is still running (its run.json and manifests, with their ETags and LastModified), then LIST the runs not seen yet
  (and the detector caches of runs that have one). Then one round GETs every JSON object whose ETag changed and
  every detector cache file not here, of all runs at once. A finished run is listed again only every `recheck_s`
  (60 s): a poll costs 1 + (live runs) LISTs plus the GETs of what changed. A run gone from the bucket leaves the
  mirror.
- **ensure(files)**: the segments a query reads that are not here yet, fetched in parallel (segments never change:
  a name present is a segment complete); a query of one run's steps, metrics, alerts or detector_state brings the
  run's other three small tables in the same round (its first page reads all four). A table once read is kept up to
  date: a new manifest's segments for it are fetched (all runs in one round) before the manifest is written into the
  mirror, so the local reader never lists a missing file.
- Segment files that no manifest lists any more (merged away) are deleted at the sync that sees the new manifest.
- **Disk**: the JSON metadata of every run (a few KB each) plus the segments of the (run, table) pairs read, at
  most `max_bytes` (default 10 GiB, `$LLD_MONITOR_MIRROR_GB`): past that the least recently read pairs are dropped
  and fetched again if needed. Where: `$LLD_MONITOR_CACHE/mirrors/<hash of the URL>/` (~/.cache/lld-monitor/...);
  processes reading one URL share it (a file lock orders their syncs).
- **Liveness** on the server's clock: `heartbeat_age` is the server's `Date` (a presigned HEAD, every 30 s while a
  run is live, carried forward on this process's monotonic clock) minus the manifest's `LastModified`. Neither the
  writer's clock nor the reader's is trusted. Where no `Date` can be had (gs://, az://) it is the time since the
  manifest's ETag last changed, on this process's monotonic clock.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lld_monitor.files import atomic_write, exclusive_lock, user_cache_dir

from . import layout
from .bucket import Bucket, ObjectInfo
from .storedir import read_bucket_store

log = logging.getLogger(__name__)

MIRROR_GB_ENV = "LLD_MONITOR_MIRROR_GB"
DEFAULT_MAX_GB = 10.0
POLL_S = 1.0
RECHECK_FINISHED_S = 60.0
CLOCK_EVERY_S = 30.0
TOGETHER = ("steps", "metrics", "alerts", "detector_state")  # a run's small tables, fetched in one round (ensure)


@dataclass
class _Run:
    etags: dict[str, str | None] = field(default_factory=dict)  # run-level object name -> ETag mirrored
    modified: dict[str, _dt.datetime] = field(default_factory=dict)  # manifest name -> LastModified
    changed_at: dict[str, float] = field(default_factory=dict)  # manifest name -> monotonic time its ETag changed
    finished: bool = False
    checked: float = float("-inf")


def mirror_root(url: str) -> Path:
    """Where the mirror of `url` lives (one per URL and endpoint)."""
    ident = f"{url}|{os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL') or ''}"
    return user_cache_dir() / "mirrors" / hashlib.sha1(ident.encode()).hexdigest()[:16]  # noqa: S324 - a name


def _write_bytes(path: Path, data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, write)


class BucketMirror:
    """The mirror of one bucket store. Thread-safe; `StoreReader(url)` makes and uses one."""

    def __init__(self, url: str, root: str | os.PathLike | None = None, *, max_bytes: int | None = None,
                 poll_s: float = POLL_S, recheck_s: float = RECHECK_FINISHED_S):
        self.bucket = Bucket(url)
        self.url = self.bucket.url
        self.root = Path(root) if root is not None else mirror_root(self.url)
        gb = float(os.environ.get(MIRROR_GB_ENV) or DEFAULT_MAX_GB)
        self.max_bytes = int(max_bytes if max_bytes is not None else gb * 2**30)
        self.poll_s = poll_s
        self.recheck_s = recheck_s
        self._lock = threading.RLock()
        self._runs: dict[str, _Run] = {}
        self._used: dict[tuple[str, str], float] = {}  # (run, table) -> last read (monotonic): kept up to date
        self._last_sync = float("-inf")
        self._clock: tuple[_dt.datetime, float] | None = None
        self._clock_at = float("-inf")
        self.fetched_bytes = 0
        # store.json and the LIST the first sync needs, in one round (a reader opens a store to read its runs)
        (self.version, store_json), self._first_list = self.bucket.map(
            lambda f: f(), [lambda: read_bucket_store(self.bucket), self._list_recursively])
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".mirror-of").write_text(self.url + "\n")
        self._sizes: dict[tuple[str, str], int] = self._scan_sizes()
        if store_json is not None:
            self._mirror_store_json(store_json)

    # ------------------------------------------------------------------ helpers
    def _list_recursively(self) -> tuple[float, list[ObjectInfo]] | None:
        try:
            return time.monotonic(), self.bucket.list_all(layout.RUNS_DIR)
        except Exception:  # noqa: BLE001 - the first sync lists again, and says what is wrong
            return None

    def _lockfile(self) -> Path:
        return self.root / ".sync.lock"

    def _scan_sizes(self) -> dict[tuple[str, str], int]:
        sizes: dict[tuple[str, str], int] = {}
        runs = self.root / layout.RUNS_DIR
        if runs.is_dir():
            for f in runs.glob("*/*/*.parquet"):
                key = (f.parent.parent.name, f.parent.name)
                sizes[key] = sizes.get(key, 0) + f.stat().st_size
        return sizes

    def _mirror_store_json(self, data: bytes) -> None:
        local = self.root / layout.STORE_FILE
        if not local.exists() or local.read_bytes() != data:
            _write_bytes(local, data)

    def local_path(self, key: str) -> Path:
        return self.root / key

    def key_of(self, path: str | os.PathLike) -> str:
        return Path(path).relative_to(self.root).as_posix()

    def invalidate(self) -> None:
        """The next sync() asks the bucket whatever poll_s says (a query found the mirror behind)."""
        self._last_sync = float("-inf")

    @property
    def disk_bytes(self) -> int:
        return sum(self._sizes.values())

    # ------------------------------------------------------------------ sync
    def sync(self, force: bool = False) -> None:
        """Bring the runs' metadata (and the segments of tables in use) up to the bucket's state."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_sync < self.poll_s:
                return
            with exclusive_lock(self._lockfile()):
                self._sync_locked()
            self._last_sync = time.monotonic()

    def _sync_locked(self) -> None:
        if self.version is None:
            self.version, store_json = read_bucket_store(self.bucket)
            if store_json is None:
                return
            self._mirror_store_json(store_json)
        now = time.monotonic()
        present, listed = self._list_runs(now)
        changed: list[tuple[str, ObjectInfo]] = []  # run.json / manifests to fetch
        for rid, (objs, _) in listed.items():
            st = self._runs.setdefault(rid, _Run())
            st.checked = now
            names = {}
            for o in objs:
                name = o.key.rsplit("/", 1)[-1]
                if name == layout.RUN_FILE or (name.startswith(layout.MANIFEST_PREFIX) and name.endswith(".json")):
                    names[name] = o
                    if name.startswith(layout.MANIFEST_PREFIX):
                        st.modified[name] = o.last_modified
                    if st.etags.get(name) != o.etag or not (self.root / o.key).exists():
                        changed.append((rid, o))
            for gone in set(st.etags) - set(names):  # a manifest deleted (overwrite=True)
                (self.root / layout.RUNS_DIR / rid / gone).unlink(missing_ok=True)
                st.etags.pop(gone, None)
                st.modified.pop(gone, None)
        caches = [o.key for _, cache in listed.values() for o in cache if not (self.root / o.key).exists()]
        # one round for every changed JSON object and every missing detector cache file, of all runs
        bodies = self.bucket.map(self.bucket.get, [o.key for _, o in changed] + caches)
        for key, (data, _) in zip(caches, bodies[len(changed):]):
            self._store(key, data)
        by_run: dict[str, list[tuple[ObjectInfo, bytes]]] = {}
        for (rid, _), (data, info) in zip(changed, bodies):
            by_run.setdefault(rid, []).append((info, data))
        # the segments the new manifests list for tables in use, all runs in one round, before the manifests: the
        # local reader never lists a file that is not here
        self._fetch([k for rid, items in by_run.items() for k in self._in_use(rid, items)
                     if not (self.root / k).exists()])
        for rid, items in by_run.items():
            self._write_run(rid, items)
        for rid, (_, cache) in listed.items():
            self._drop_stale_caches(rid, {o.key.rsplit("/", 1)[-1] for o in cache})
            self._update_finished(rid)
        for rdir in list((self.root / layout.RUNS_DIR).glob("*")) if (self.root / layout.RUNS_DIR).is_dir() else []:
            if rdir.name not in present:  # deleted from the bucket
                shutil.rmtree(rdir, ignore_errors=True)
                self._runs.pop(rdir.name, None)
                for k in [k for k in self._sizes if k[0] == rdir.name]:
                    self._sizes.pop(k)
                    self._used.pop(k, None)
        if any(not st.finished for rid, st in self._runs.items() if rid in present):
            self._refresh_clock()

    def _list_runs(self, now: float) -> tuple[set[str], dict[str, tuple[list[ObjectInfo], list[ObjectInfo]]]]:
        """(the run ids in the bucket, {run due for a look: (the objects in its folder, its detector cache)}).

        The first sync lists `runs/` recursively (one request per 1,000 objects; a run holds a few dozen) instead of
        the run list, then one LIST per run, then one per detector cache; the mirror made that LIST when it opened,
        beside its GET of store.json, and uses it if it is at most `poll_s` old. Later syncs list, in one round, `runs/`
        and the runs known to be live (finished ones every `recheck_s`), then in a second round the runs new to us,
        then the detector caches of the runs listed."""
        first, self._first_list = self._first_list, None
        if not self._runs:
            if first is None or now - first[0] > self.poll_s:  # the one made at open is too old
                first = (now, self.bucket.list_all(layout.RUNS_DIR))
            got: dict[str, tuple[list[ObjectInfo], list[ObjectInfo]]] = {}
            for o in first[1]:
                parts = o.key.split("/")
                if len(parts) < 3:
                    continue
                objs, cache = got.setdefault(parts[1], ([], []))
                if len(parts) == 3:
                    objs.append(o)
                elif len(parts) == 4 and parts[2] == layout.DETECTOR_CACHE_DIR:
                    cache.append(o)
            return set(got), {rid: v for rid, v in got.items() if layout.valid_run_id(rid)}

        def due(rid: str) -> bool:
            st = self._runs.get(rid)
            return not (st is not None and st.finished and now - st.checked < self.recheck_s
                        and (self.root / layout.RUNS_DIR / rid).is_dir())

        def run_dir(rid: str) -> str:
            return f"{layout.RUNS_DIR}/{rid}"

        known = [rid for rid in self._runs if due(rid)]
        lists = self.bucket.map(self.bucket.list_dir, [layout.RUNS_DIR] + [run_dir(rid) for rid in known])
        run_ids = lists[0][0]
        present = set(run_ids)
        got = {rid: lst for rid, lst in zip(known, lists[1:]) if rid in present}
        new = [rid for rid in run_ids if layout.valid_run_id(rid) and rid not in got and due(rid)]
        got.update(zip(new, self.bucket.map(self.bucket.list_dir, [run_dir(rid) for rid in new])))
        with_cache = [rid for rid, (subs, _) in got.items() if layout.DETECTOR_CACHE_DIR in subs]
        caches = dict(zip(with_cache, self.bucket.map(self.bucket.list_dir, [
            f"{run_dir(rid)}/{layout.DETECTOR_CACHE_DIR}" for rid in with_cache])))
        return present, {rid: (objs, caches[rid][1] if rid in caches else []) for rid, (_, objs) in got.items()}

    def _in_use(self, rid: str, items: list[tuple[ObjectInfo, bytes]]) -> list[str]:
        """The segment keys that the changed manifests among `items` list for the run's tables in use."""
        want: list[str] = []
        for info, data in items:
            if not info.key.rsplit("/", 1)[-1].startswith(layout.MANIFEST_PREFIX):
                continue
            try:
                man = json.loads(data)
            except ValueError:
                continue  # the reader says it is unreadable
            for t, segs in (man.get("segments") or {}).items():
                if (rid, t) in self._used:
                    want += [f"{layout.RUNS_DIR}/{rid}/{t}/{s['file']}" for s in segs if isinstance(s, dict)]
        return want

    def _write_run(self, rid: str, items: list[tuple[ObjectInfo, bytes]]) -> None:
        """Write the changed run.json / manifests of one run into the mirror (the segments they list for tables in use
        are here), then drop the segments no manifest lists."""
        st = self._runs[rid]
        for info, data in items:
            name = info.key.rsplit("/", 1)[-1]
            _write_bytes(self.root / info.key, data)
            if st.etags.get(name) != info.etag and name.startswith(layout.MANIFEST_PREFIX):
                st.changed_at[name] = time.monotonic()
            st.etags[name] = info.etag
        self._drop_unlisted(rid, self.root / layout.RUNS_DIR / rid)

    def _listed(self, rdir: Path) -> dict[str, set[str]]:
        listed: dict[str, set[str]] = {}
        for m in rdir.glob(f"{layout.MANIFEST_PREFIX}*.json"):
            try:
                man = layout.read_json(m)
            except (OSError, ValueError):
                return {}  # cannot tell: drop nothing
            for t, segs in (man.get("segments") or {}).items():
                listed.setdefault(t, set()).update(s["file"] for s in segs if isinstance(s, dict))
        return listed

    def _drop_unlisted(self, rid: str, rdir: Path) -> None:
        listed = self._listed(rdir)
        if not listed:
            return
        for t in layout.DATA_TABLES:
            tdir = rdir / t
            if not tdir.is_dir():
                continue
            for f in tdir.glob("*.parquet"):
                if f.name not in listed.get(t, ()):
                    size = f.stat().st_size
                    f.unlink(missing_ok=True)
                    self._sizes[(rid, t)] = max(0, self._sizes.get((rid, t), 0) - size)

    def _drop_stale_caches(self, rid: str, keep: set[str]) -> None:
        local_dir = self.root / layout.RUNS_DIR / rid / layout.DETECTOR_CACHE_DIR
        if local_dir.is_dir():
            for f in local_dir.iterdir():
                if f.name not in keep and not f.name.startswith("."):
                    size = f.stat().st_size
                    f.unlink(missing_ok=True)
                    k = (rid, layout.DETECTOR_CACHE_DIR)
                    self._sizes[k] = max(0, self._sizes.get(k, 0) - size)

    def _update_finished(self, rid: str) -> None:
        st = self._runs.get(rid)
        rdir = self.root / layout.RUNS_DIR / rid
        if st is None:
            return
        statuses = []
        for m in rdir.glob(f"{layout.MANIFEST_PREFIX}*.json"):
            try:
                statuses.append(layout.read_json(m).get("status", "running"))
            except (OSError, ValueError):
                statuses.append("running")
        st.finished = bool(statuses) and all(s != "running" for s in statuses)

    # ------------------------------------------------------------------ segments
    def ensure(self, files: list[str]) -> None:
        """Make sure each of `files` (paths in the mirror) is here; fetch the missing ones in parallel. FileNotFoundError
        when one is gone from the bucket too (merged away: the caller re-plans on fresh manifests).

        A query of one run's `steps`, `metrics`, `alerts` or `detector_state` that finds segments missing also brings
        the missing segments of the run's other three in the same round: a run's first page reads all four (the run
        overview), one after another. `samples` and `tokens`, the big tables, come only when read."""
        with self._lock:
            now = time.monotonic()
            keys = [self.key_of(f) for f in files]
            pairs = {(k.split("/")[1], k.split("/")[2]) for k in keys
                     if k.count("/") >= 3 and k.startswith(layout.RUNS_DIR + "/")}
            missing = [k for k, f in zip(keys, files) if not os.path.exists(f)]
            extra: list[str] = []
            if missing and len({rid for rid, _ in pairs}) == 1 and any(t in TOGETHER for _, t in pairs):
                rid = next(iter(pairs))[0]
                for t, names in self._listed(self.root / layout.RUNS_DIR / rid).items():
                    if t in TOGETHER and (rid, t) not in pairs:
                        self._used[(rid, t)] = now  # kept up to date from now on, as a table read
                        extra += [k for k in (f"{layout.RUNS_DIR}/{rid}/{t}/{n}" for n in sorted(names))
                                  if not (self.root / k).exists()]
            for k in pairs:
                self._used[k] = now
            if missing:
                self._fetch(missing, optional=extra)
                self._evict(keep=pairs)

    def _fetch(self, keys: list[str], optional: Sequence[str] = ()) -> None:
        """GET `keys`, and the `optional` ones (skipped when gone from the bucket), in one round, into the mirror."""
        skip = set(optional) - set(keys)

        def get(key: str) -> bytes | None:
            try:
                return self.bucket.get(key)[0]
            except FileNotFoundError:
                if key in skip:
                    return None
                raise

        todo = list(keys) + sorted(skip)
        if todo:
            for key, data in zip(todo, self.bucket.map(get, todo)):
                if data is not None:
                    self._store(key, data)

    def _store(self, key: str, data: bytes) -> None:
        _write_bytes(self.root / key, data)
        self.fetched_bytes += len(data)
        parts = key.split("/")
        if len(parts) >= 4 and parts[0] == layout.RUNS_DIR and key.endswith(".parquet"):
            k = (parts[1], parts[2])
            self._sizes[k] = self._sizes.get(k, 0) + len(data)

    def _evict(self, keep: set[tuple[str, str]]) -> None:
        """Drop the least recently read (run, table) segments until the mirror is within max_bytes."""
        total = self.disk_bytes
        if total <= self.max_bytes:
            return
        for k in sorted(self._sizes, key=lambda k: self._used.get(k, float("-inf"))):
            if total <= self.max_bytes:
                break
            if k in keep:
                continue
            tdir = self.root / layout.RUNS_DIR / k[0] / k[1]
            for f in tdir.glob("*.parquet"):
                f.unlink(missing_ok=True)
            total -= self._sizes.pop(k)
            self._used.pop(k, None)
            log.info("mirror of %s over %.1f GB: dropped the local copy of %s/%s (fetched again when read)", self.url,
                     self.max_bytes / 2**30, *k)
        if total > self.max_bytes:
            log.warning("the mirror of %s holds %.1f GB, above its %.1f GB bound, for the query being answered "
                        "(raise $%s)", self.url, total / 2**30, self.max_bytes / 2**30, MIRROR_GB_ENV)

    # ------------------------------------------------------------------ liveness
    def _refresh_clock(self) -> None:
        if time.monotonic() - self._clock_at < CLOCK_EVERY_S and self._clock is not None:
            return
        self._clock_at = time.monotonic()
        try:
            got = self.bucket.server_time(layout.STORE_FILE)
        except Exception as e:  # noqa: BLE001 - liveness falls back to the ETag watch
            log.debug("no server time from %s: %s", self.url, e)
            got = None
        if got is not None:
            self._clock = got

    def server_now(self) -> _dt.datetime | None:
        """The server's clock now: its last Date plus the monotonic time since (None if never read)."""
        if self._clock is None:
            return None
        date, mono = self._clock
        return date + _dt.timedelta(seconds=time.monotonic() - mono)

    def heartbeat_age(self, manifest_path: str | os.PathLike) -> float | None:
        """Seconds since the manifest was last written, on the server's clock (or since its ETag last changed here)."""
        p = Path(manifest_path)
        st = self._runs.get(p.parent.name)
        if st is None:
            return None
        lm = st.modified.get(p.name)
        now = self.server_now()
        if lm is not None and now is not None:
            return max(0.0, (now - lm).total_seconds())
        changed = st.changed_at.get(p.name)
        return None if changed is None else time.monotonic() - changed

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "root": str(self.root), "disk_bytes": self.disk_bytes, "max_bytes": self.max_bytes,
                "requests": self.bucket.requests, "fetched_bytes": self.fetched_bytes}
