"""Online W&B import against a stand-in for `wandb.Api` (there is no network here, and a real wandb.Api
must never be constructed in tests). The stand-in raises wandb's own CommError wrapping a requests
HTTPError, as the SDK does, and pages both the run listing and the history."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest
import requests
from wandb.errors import CommError

from lld_monitor.integrations.wandb.importer import RetryPolicy, import_online, is_rate_limit

SECRET = "wandb-secret-key-0123456789abcdef0123"


def http_error(code: int, retry_after: str | None = None) -> CommError:
    r = requests.Response()
    r.status_code = code
    if retry_after is not None:
        r.headers["Retry-After"] = retry_after
    return CommError(f"HTTP {code}", exc=requests.HTTPError(f"{code} Client Error", response=r))


def row_value(key: str, step: int) -> float:
    if key == "actor/grad_norm" and step % 97 == 5:
        return float("nan")
    return (hash((key, step)) % 100_000) / 1000.0


class FakeRun:
    def __init__(self, rid, n_rows, keys, *, config=None, state="finished", fail_at=(), project="proj"):
        self.id = rid
        self.name = f"name {rid}"
        self.project = project
        self.entity = "ent"
        self.config = config or {}
        self.state = state
        self.created_at = "2026-11-30T10:00:00Z"
        self.summary = {"x": 1}
        self.url = f"https://wandb.ai/ent/{project}/runs/{rid}"
        self.lastHistoryStep = n_rows - 1
        self.n_rows = n_rows
        self.keys = keys
        self.fail_at = list(fail_at)  # row indices where one page request fails once
        self.scan_calls: list[tuple[int, int]] = []  # (min_step, page_size)
        self.pages_served = 0

    def row(self, step):
        r = {k: row_value(k, step) for k in self.keys}
        r["_step"] = step
        r["_timestamp"] = 1.8e9 + step
        r["_runtime"] = float(step)
        if step >= self.n_rows // 2:
            r["late/key"] = float(step)  # a key that appears mid-run
        return r

    def scan_history(self, keys=None, page_size=1000, min_step=0, max_step=None, use_cache=True):
        self.scan_calls.append((min_step, page_size))
        step = min_step
        while step < self.n_rows:
            end = min(step + page_size, self.n_rows)
            if self.fail_at and step <= self.fail_at[0] < end:
                self.fail_at.pop(0)
                # fail in the middle of iterating: the rows of the page before the failure were delivered
                for s in range(step, self.fail_at_prefix(step, end)):
                    yield self.row(s)
                raise http_error(429, retry_after="0.25")
            self.pages_served += 1
            for s in range(step, end):
                yield self.row(s)
            step = end

    @staticmethod
    def fail_at_prefix(start, end):
        return start + (end - start) // 2


class FakeRuns:
    """Pages lazily like wandb.apis.public.Runs; one page fetch fails once with a 429."""

    def __init__(self, runs, per_page, fail_page=None):
        self.runs, self.per_page, self.fail_page = runs, per_page, fail_page
        self.pages = 0

    def __iter__(self):
        i = 0
        while i < len(self.runs):
            if i % self.per_page == 0:
                page = i // self.per_page
                if page == self.fail_page:
                    self.fail_page = None
                    raise http_error(429)
                self.pages += 1
            yield self.runs[i]
            i += 1


class PaginatorLike:
    """Mimics wandb.apis.paginator.Paginator.__next__: `index` is bumped BEFORE the next page is loaded,
    so a page load that raises leaves the index one ahead."""

    def __init__(self, fr):
        self.fr = fr
        self.index = -1
        self.next_page = 0
        self.objects: list = []

    def __iter__(self):
        return self

    def _load_page(self) -> bool:
        page = self.next_page
        if page * self.fr.per_page >= len(self.fr.runs):
            return False
        if page == self.fr.fail_page:
            self.fr.fail_page = None
            raise http_error(429)
        self.fr.pages += 1
        self.next_page += 1
        self.objects += self.fr.runs[page * self.fr.per_page : (page + 1) * self.fr.per_page]
        return True

    def __next__(self):
        self.index += 1
        if len(self.objects) <= self.index:
            if not self._load_page():
                raise StopIteration
            if len(self.objects) <= self.index:
                raise StopIteration
        return self.objects[self.index]


class FakeRunsLazy(FakeRuns):
    def __iter__(self):
        return PaginatorLike(self)


class FakeApi:
    def __init__(self, runs, per_page_fail=None, api_key=None):
        self._runs = {r.id: r for r in runs}
        self.deleted: set[str] = set()
        self.per_page_fail = per_page_fail
        self.listing: FakeRunsLazy | None = None
        self.api_key = api_key
        self.run_calls = 0

    def run(self, path):
        self.run_calls += 1
        rid = path.split("/")[-1]
        if rid in self.deleted or rid not in self._runs:
            raise CommError(f"Could not find run {path}")
        if self.run_calls == 1:
            raise http_error(503)  # a transient server error first
        return self._runs[rid]

    def runs(self, path, filters=None, order="+created_at", per_page=50):
        self.listing = FakeRunsLazy(list(self._runs.values()), per_page, fail_page=self.per_page_fail)
        return self.listing


def no_sleep_policy(waits):
    return RetryPolicy(max_tries=5, base_delay_s=0.5, sleep=waits.append, jitter=0.0)


def test_rate_limit_detection():
    assert is_rate_limit(http_error(429))
    assert not is_rate_limit(http_error(500))
    assert not is_rate_limit(CommError("run abc429 failed"))


def test_paging_rate_limit_deleted_run(tmp_path, caplog):
    from lld_monitor.store import open_store_reader

    runs = [
        FakeRun("r1", 2500, ["critic/score/mean", "actor/grad_norm", "actor/entropy_loss"],
                config={"actor_rollout_ref": {"actor": {"no_reduce_lambda": 0.2}}}, fail_at=[1200]),
        FakeRun("r2", 30, ["train/reward", "train/grad_norm"], config={"num_generations": 8}, state="crashed"),
        FakeRun("r3", 10, ["x"], state="running"),
    ]
    api = FakeApi(runs, per_page_fail=1)
    api.deleted.add("gone")
    waits: list[float] = []
    store = tmp_path / "s"
    with caplog.at_level(logging.DEBUG):
        rep = import_online(str(store), "ent", "proj", ["r1", "gone", "r2", "r3"], api=api, page_size=500,
                            policy=no_sleep_policy(waits), progress=False)
    assert rep.missing == ["gone"] and not rep.failed
    assert [r.name for r in rep.imported] == ["name r1", "name r2", "name r3"]
    # the 503 on the first api.run and the 429 mid-history were retried; Retry-After (0.25 s) honoured
    assert rep.retries == 1 and 0.25 in waits and 0.5 in waits
    r1 = runs[0]
    assert r1.scan_calls[0] == (0, 500) and r1.scan_calls[1][0] == 1000 + 250  # resumed after the last row
    with open_store_reader(store) as r:
        got = r.metrics(rep.imported[0].run_id)
        assert not got.duplicated(["step", "key"]).any()
        for key in ["critic/score/mean", "actor/grad_norm", "actor/entropy_loss"]:
            vals = got[got["key"] == key].sort_values("step")
            assert vals["step"].tolist() == list(range(2500))
            for s, v in zip(vals["step"], vals["value"], strict=True):
                want = row_value(key, int(s))
                assert (math.isnan(v) and math.isnan(want)) or v == want
        late = got[got["key"] == "late/key"]
        assert late["step"].min() == 1250 and len(late) == 1250
        runs_df = r.runs().set_index("run_id")
        st = {rr.name: runs_df.loc[rr.run_id] for rr in rep.imported}
        assert st["name r1"]["mode"] == "llds" and st["name r1"]["status"] == "finished"
        assert st["name r2"]["mode"] == "vanilla" and st["name r2"]["status"] == "crashed"
        assert st["name r3"]["status"] == "finished"  # a running W&B run is stored as a snapshot
        steps = r.steps(rep.imported[1].run_id)
        assert steps["reward_mean"].notna().all()
    # all runs of the project (listing paged 2 per page, page 1 fails once with a 429)
    waits.clear()
    rep2 = import_online(str(store), "ent", "proj", api=api, per_page=2, policy=no_sleep_policy(waits),
                         progress=False)
    assert sorted(x.name for x in rep2.imported) == ["name r1", "name r2", "name r3"]
    assert api.listing.pages == 2 and waits  # two pages fetched, one retry
    with open_store_reader(store) as r:
        assert len(r.runs()) == 3  # re-import replaced, did not duplicate


def test_api_key_never_stored_or_logged(tmp_path, caplog, monkeypatch):
    import lld_monitor.integrations.wandb.importer as wi

    made = {}

    def fake_make_api(api_key=None, timeout=30):
        made["key"] = api_key
        return FakeApi([FakeRun("k1", 20, ["critic/score/mean"])])

    monkeypatch.setattr(wi, "make_api", fake_make_api)
    monkeypatch.setattr(FakeApi, "run", lambda self, path: self._runs[path.split("/")[-1]])
    with caplog.at_level(logging.DEBUG):
        rep = wi.import_online(str(tmp_path / "s"), "ent", "proj", ["k1"], api_key=SECRET, progress=False)
    assert made["key"] == SECRET and rep.imported
    assert SECRET not in caplog.text
    for f in Path(tmp_path / "s").rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_make_api_error_does_not_echo_the_key(monkeypatch):
    import wandb

    import lld_monitor.integrations.wandb.importer as wi

    def boom(*a, **kw):
        raise wandb.errors.AuthenticationError(f"bad key {kw.get('api_key')}")

    monkeypatch.setattr(wandb, "Api", boom)
    with pytest.raises(wi.ImportError_) as ei:
        wi.make_api(api_key=SECRET)
    assert SECRET not in str(ei.value) and ei.value.__cause__ is None and "wandb login" in str(ei.value)


def test_100k_rows(tmp_path):
    from lld_monitor.store import open_store_reader

    run = FakeRun("big", 100_000, ["critic/score/mean", "actor/grad_norm", "actor/pg_clipfrac", "actor/kl_loss",
                                   "actor/ppo_kl", "timing_s/step"])
    api = FakeApi([run])
    api.run_calls = 1  # no transient error on this one
    t0 = time.perf_counter()
    rep = import_online(str(tmp_path / "s"), "ent", "proj", ["big"], api=api, page_size=1000, progress=False)
    dt = time.perf_counter() - t0
    res = rep.imported[0]
    assert res.rows == 100_000 and res.steps == 100_000
    print(f"\nonline import (fake API): 100,000 rows x 9 keys in {dt:.2f} s = {100_000 / dt:,.0f} rows/s")
    with open_store_reader(tmp_path / "s") as r:
        st = r.steps(res.run_id, columns=["step", "grad_norm"])
        assert len(st) == 100_000 and st["step"].is_monotonic_increasing
        n = r.sql("select count(*) as n from metrics where run_id = ?", [res.run_id])["n"].iloc[0]
        # 6 keys + _timestamp + _runtime, late/key half, + the summary-only scalar `x`
        assert n == res.metric_values == 100_000 * 8 + 50_000 + 1
    assert res.summary_keys == ["x"]
