"""Import W&B runs into a run store: online through `wandb.Api()`, or offline from `wandb/` folders.

Online
- The API key is whatever `wandb.Api()` finds in the usual places (`WANDB_API_KEY`, `~/.netrc`, the
  settings written by `wandb login`); a caller may pass `api_key` explicitly (the dashboard page does, from
  a password field). The key is handed to `wandb.Api` and nowhere else: it is not stored, logged or put in
  an exception message by this module.
- History comes from `run.scan_history(page_size=...)` (every row, not the sampled `run.history()`).
  A failure mid-scan (rate limit, 5xx, connection drop) is retried with exponential back-off and the scan
  resumes at the next step (`min_step=last_step + 1`), so no row is read twice or lost.
- Rate limits (HTTP 429) honour `Retry-After` when the error carries it.
- A run that does not exist (deleted, or a typo) is reported and skipped; the other runs still import.

Offline: `import_offline(store, path)` reads every `.wandb` file under `path` with no network
(`offline_file.py`), merging the segments of a run resumed offline.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .offline_file import WandbRunData, read_offline_runs
from .write_run import ImportResult, ImportSpec, write_run

log = logging.getLogger(__name__)

STATE_TO_STATUS = {
    "finished": "finished",
    "running": "running",
    "pending": "running",
    "preempting": "running",
    "crashed": "crashed",
    "failed": "crashed",
    "killed": "crashed",
    "preempted": "crashed",
}


class ImportError_(RuntimeError):
    """An import failed in a way the user can act on (message says what to do)."""


class RunNotFound(ImportError_):
    pass


@dataclass
class RetryPolicy:
    max_tries: int = 6
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0
    factor: float = 2.0
    jitter: float = 0.1
    sleep: Callable[[float], None] = time.sleep


def _status_code(exc: BaseException) -> int | None:
    """HTTP status carried by a wandb / requests error, looking through the exception chain."""
    for e in _chain(exc):
        for attr in ("status_code", "http_status", "code"):
            v = getattr(e, attr, None)
            if isinstance(v, int) and 100 <= v < 600:
                return v
        resp = getattr(e, "response", None)
        v = getattr(resp, "status_code", None)
        if isinstance(v, int):
            return v
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes/contexts and wandb's wrapped `.exc`, each once."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for nxt in (getattr(e, "exc", None), e.__cause__, e.__context__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def _retry_after(exc: BaseException) -> float | None:
    for e in _chain(exc):
        resp = getattr(e, "response", None)
        headers = getattr(resp, "headers", None) or {}
        v = headers.get("Retry-After") if hasattr(headers, "get") else None
        if v is not None:
            try:
                return float(v)
            except ValueError:
                return None
    return None


def is_rate_limit(exc: BaseException) -> bool:
    text = str(exc).lower()
    return _status_code(exc) == 429 or "rate limit" in text or "too many requests" in text


def is_not_found(exc: BaseException) -> bool:
    code = _status_code(exc)
    if code == 404:
        return True
    text = str(exc).lower()
    return "could not find run" in text or "not found" in text or "does not exist" in text


def is_transient(exc: BaseException) -> bool:
    if is_rate_limit(exc):
        return True
    code = _status_code(exc)
    if code is not None:
        return code >= 500 or code == 408
    name = type(exc).__name__.lower()
    return any(s in name for s in ("timeout", "connection", "temporar"))


def with_retries(fn: Callable[[], Any], what: str, policy: RetryPolicy) -> Any:
    """Call fn(); on a transient error wait (exponential back-off, Retry-After honoured) and try again."""
    delay = policy.base_delay_s
    for attempt in range(1, policy.max_tries + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            if not is_transient(exc) or attempt == policy.max_tries:
                raise
            wait = _retry_after(exc) if is_rate_limit(exc) else None
            wait = min(policy.max_delay_s, wait if wait is not None else delay)
            wait *= 1 + policy.jitter * random.random()
            log.warning(
                "%s: %s (%s); retry %d/%d in %.1f s",
                what,
                "rate limited" if is_rate_limit(exc) else "transient error",
                type(exc).__name__,
                attempt,
                policy.max_tries - 1,
                wait,
            )
            policy.sleep(wait)
            delay = min(policy.max_delay_s, delay * policy.factor)
    raise AssertionError("unreachable")


def resilient_history(
    run: Any, policy: RetryPolicy, page_size: int = 1000, retries: list[int] | None = None
) -> Iterator[dict[str, Any]]:
    """Every history row of an online run; a failed page is retried and the scan resumes after the last
    step received. `retries` (a list) gets one entry per retry, for reporting."""
    min_step = 0
    failures = 0
    delay = policy.base_delay_s
    while True:
        try:
            for row in run.scan_history(page_size=page_size, min_step=min_step):
                step = row.get("_step")
                if isinstance(step, (int, float)) and step < min_step:
                    continue  # a server that ignores min_step: skip what we already have
                yield row
                if isinstance(step, (int, float)):
                    min_step = int(step) + 1
                failures = 0
            return
        except Exception as exc:  # noqa: BLE001
            failures += 1
            if not is_transient(exc) or failures >= policy.max_tries:
                raise
            wait = _retry_after(exc) if is_rate_limit(exc) else None
            wait = min(policy.max_delay_s, wait if wait is not None else delay)
            log.warning(
                "history of %s: %s at step %d; retry %d/%d in %.1f s",
                getattr(run, "id", "?"),
                "rate limited" if is_rate_limit(exc) else f"transient error ({type(exc).__name__})",
                min_step,
                failures,
                policy.max_tries - 1,
                wait,
            )
            if retries is not None:
                retries.append(min_step)
            policy.sleep(wait)
            delay = min(policy.max_delay_s, delay * policy.factor)


def _next_run(it: Any) -> Any:
    """next() on a wandb Paginator that survives a failed page load: `Paginator.__next__` bumps `index`
    before loading the next page, so a retry after an error would skip a run; put the index back."""
    idx = getattr(it, "index", None)
    try:
        return next(it)
    except StopIteration:
        raise
    except Exception:
        if isinstance(idx, int):
            it.index = idx
        raise


def make_api(api_key: str | None = None, timeout: int = 30) -> Any:
    """A real `wandb.Api`. Without `api_key`, the key comes from the usual W&B places."""
    try:
        import wandb  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover
        raise ImportError_("the wandb package is missing: pip install -r requirements.txt") from exc
    try:
        if api_key:
            return wandb.Api(api_key=api_key, timeout=timeout)
        return wandb.Api(timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        # never echo the key: describe the failure by type only
        raise ImportError_(
            f"could not connect to W&B ({type(exc).__name__}). Set WANDB_API_KEY or run `wandb login`, "
            "check the network, or import offline folders with --offline DIR."
        ) from None


def _created_at(run: Any) -> datetime | None:
    v = getattr(run, "created_at", None)
    if isinstance(v, datetime):
        return v if v.tzinfo else v.replace(tzinfo=timezone.utc)
    if isinstance(v, str) and v:
        try:
            d = datetime.fromisoformat(v.replace("Z", "+00:00"))
            return d if d.tzinfo else d.replace(tzinfo=timezone.utc)
        except ValueError:
            return None
    return None


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def spec_from_api_run(run: Any, entity: str | None, project: str | None) -> ImportSpec:
    config = _plain(dict(getattr(run, "config", {}) or {}))
    config.pop("_wandb", None)
    state = str(getattr(run, "state", "finished") or "finished")
    try:
        summary = _plain(dict(getattr(run, "summary", {}) or {}))
    except Exception:  # noqa: BLE001  (summary access can hit the network)
        summary = {}
    return ImportSpec(
        wandb_id=str(run.id),
        project=getattr(run, "project", None) or project,
        entity=getattr(run, "entity", None) or entity,
        name=getattr(run, "name", None) or str(run.id),
        config=config,
        status=STATE_TO_STATUS.get(state, "finished"),
        started_at=_created_at(run),
        origin=getattr(run, "url", None) or f"wandb:{entity}/{project}/{run.id}",
        summary=summary,
    )


@dataclass
class OnlineReport:
    imported: list[ImportResult]
    missing: list[str]  # run ids that do not exist (deleted or mistyped)
    failed: dict[str, str]  # run id -> error text
    retries: int


def import_online(
    store: str,
    entity: str,
    project: str,
    run_ids: Iterable[str] | None = None,
    *,
    api: Any = None,
    api_key: str | None = None,
    mode: str | None = None,
    page_size: int = 1000,
    per_page: int = 50,
    policy: RetryPolicy | None = None,
    progress: bool = True,
) -> OnlineReport:
    """Import runs of `entity/project` (all of them, or `run_ids`) into `store`."""
    policy = policy or RetryPolicy()
    api = api if api is not None else make_api(api_key)
    path = f"{entity}/{project}"
    runs: list[Any] = []
    missing: list[str] = []
    failed: dict[str, str] = {}

    def skip(rid: str, exc: Exception, gone: str, broken: str) -> None:
        """A run that is gone goes to `missing`, any other error to `failed`; the import goes on."""
        if is_not_found(exc):
            log.warning("run %s/%s %s: skipped", path, rid, gone)
            missing.append(rid)
        else:
            failed[rid] = f"{type(exc).__name__}: {exc}"
            log.error("run %s/%s %s: %s", path, rid, broken, failed[rid])

    if run_ids:
        for rid in run_ids:
            try:
                runs.append(with_retries(lambda rid=rid: api.run(f"{path}/{rid}"), f"run {rid}", policy))
            except Exception as exc:  # noqa: BLE001
                skip(rid, exc, "not found (deleted, or a wrong id)", "could not be read")
    else:
        listing = with_retries(lambda: api.runs(path, per_page=per_page), f"runs of {path}", policy)
        it = iter(listing)
        while True:  # the Runs object fetches pages lazily while iterating: retry a failed page
            try:
                runs.append(with_retries(lambda: _next_run(it), f"runs of {path}", policy))
            except StopIteration:
                break
    retries: list[int] = []
    imported: list[ImportResult] = []
    for run in runs:
        rid = str(getattr(run, "id", "?"))
        try:
            spec = spec_from_api_run(run, entity, project)
            total = getattr(run, "lastHistoryStep", None)
            total = int(total) + 1 if isinstance(total, (int, float)) and total >= 0 else None
            res = write_run(
                store,
                spec,
                resilient_history(run, policy, page_size=page_size, retries=retries),
                mode=mode,
                total_rows=total,
                progress=progress,
            )
            imported.append(res)
            log.info("imported %s (%d rows, %.0f rows/s) as %s", rid, res.rows, res.rows_per_s, res.run_id)
        except Exception as exc:  # noqa: BLE001
            skip(rid, exc, "disappeared during the import (deleted?)", "failed to import")
    return OnlineReport(imported=imported, missing=missing, failed=failed, retries=len(retries))


def spec_from_offline(data: WandbRunData) -> ImportSpec:
    if data.complete:
        status = "finished" if (data.exit_code or 0) == 0 else "crashed"
    else:
        status = "running"  # no exit record yet: still being written (or the process died)
    return ImportSpec(
        wandb_id=data.run_id or data.path.stem.removeprefix("run-"),
        project=data.project,
        entity=data.entity,
        name=data.name,
        config=data.config,
        status=status,
        started_at=data.start_time,
        origin=str(data.path),
        # summary-only scalars are imported from a finished file only: in a file still being written the
        # summary can be ahead of the history read so far (a key would be taken for summary-only)
        summary=data.summary if data.complete else {},
    )


def import_offline(
    store: str,
    path: str | Path,
    *,
    mode: str | None = None,
    name: str | None = None,
    progress: bool = True,
) -> list[ImportResult]:
    """Import every run under `path` (a wandb/ folder, a run folder or a .wandb file). No network."""
    runs = read_offline_runs(path)
    if not runs:
        raise ImportError_(
            f"no .wandb run files under {path}; pass a wandb/ folder, an offline-run-* folder or a .wandb file"
        )
    out = []
    for data in runs:
        res = write_run(
            store,
            spec_from_offline(data),
            data.history,
            mode=mode,
            name=name if len(runs) == 1 else None,
            total_rows=len(data.history),
            progress=progress,
        )
        res.problems = list(data.problems) + res.problems
        out.append(res)
        log.info("imported %s (%d rows, %.0f rows/s) as %s", data.path, res.rows, res.rows_per_s, res.run_id)
    return out


def results_frame(results: list[ImportResult]) -> "Any":
    """One row per imported run, for the dashboard page and the CLI (pandas DataFrame)."""
    import pandas as pd  # noqa: PLC0415

    return pd.DataFrame(
        [
            {
                "run_id": r.run_id,
                "name": r.name,
                "mode": r.mode,
                "mode from": r.mode_reason,
                "W&B state": r.status,
                "rows": r.rows,
                "steps": r.steps,
                "values": r.metric_values,
                "rows/s": round(r.rows_per_s),
                "mapped signals": ", ".join(f"{k}←{v}" for k, v in sorted(r.mapped.items())),
                "problems": "; ".join(r.problems),
            }
            for r in results
        ]
    )
