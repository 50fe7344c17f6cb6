"""Write an imported W&B run (offline file or online API) into a run store.

Shared by the offline reader and the online importer. Rules:
- every numeric history value (NaN and +/-inf included) lands in `metrics` under its W&B key, unchanged;
  `_step` is the step axis (or `train/global_step` for runs logged by transformers' WandbCallback) and is
  not repeated as a metric;
- keys with a documented meaning (`signals.KEY_MAP`) are also copied into `steps` signals, corrected as the
  run's `RunProfile` says (read once, from its config and the keys of its first rows);
- rows logged for the same step are merged (later values win), so every step has one `steps` row;
- the store run id is derived from the W&B project and run id, and the run is rewritten with
  ``overwrite=True``: re-importing updates a run, it never duplicates it;
- the API key is never seen here: only the run's config, history and state are written.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa

from lld_monitor.signals import LLD_STEP_KEY, TRL_STEP_KEY, map_row, mapped_keys
from lld_monitor.store import RunWriter, schema

from .completions import COMPLETIONS_KEYS, completions_samples, reward_function_names, summary_only, table_ref
from .run_profile import RunProfile, SignalFix, find_in_config, flatten_config

log = logging.getLogger(__name__)

BATCH_ROWS = 20_000  # history rows per append


@dataclass
class ImportSpec:
    """What we know about a W&B run before reading its history."""

    wandb_id: str
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    status: str = "finished"  # one of schema.STATUSES
    started_at: datetime | None = None
    origin: str = ""  # a path or a URL, kept in the run's config for provenance
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class ImportResult:
    run_id: str
    name: str
    mode: str
    mode_reason: str
    family: str
    rows: int  # history rows read
    steps: int  # distinct steps written
    metric_values: int  # values written to `metrics`
    mapped: dict[str, str]  # signal -> source key
    skipped_keys: list[str]  # non-numeric keys (media, tables, strings)
    status: str
    seconds: float
    problems: list[str] = field(default_factory=list)
    summary_keys: list[str] = field(default_factory=list)  # summary-only scalars kept in metrics
    samples: int = 0  # `samples` rows from TRL completions tables
    detector_seconds: float = 0.0  # the detector's replay stored beside the run (phases, alerts, forecast)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["rows_per_s"] = self.rows_per_s
        return d


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def store_run_id(project: str | None, wandb_id: str) -> str:
    """Deterministic, filesystem-safe store id of a W&B run (same for offline and online imports)."""
    raw = f"wandb-{project or 'noproject'}-{wandb_id}"
    return _SAFE.sub("_", raw).strip("._") or "wandb-run"


def _model_from_config(config: Mapping[str, Any]) -> str | None:
    flat = flatten_config(dict(config))
    for name in ("model_name_or_path", "_name_or_path", "model_name", "model_id"):
        v = find_in_config(flat, name)
        if isinstance(v, str) and v:
            return v
    v = flat.get("actor_rollout_ref.model.path")
    if isinstance(v, str):
        return v
    return None


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, complex)


def _step_of(row: Mapping[str, Any], step_key: str) -> int | None:
    """The row's step on the run's axis; rows written by our exporter carry `lld/step`, rows written by
    transformers' WandbCallback `train/global_step`, both meaning the optimizer step."""
    v = row.get(step_key)
    if v is None and step_key != "_step":
        for alt in (LLD_STEP_KEY, TRL_STEP_KEY):
            v = row.get(alt)
            if v is not None:
                break
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return int(v)


class _Accumulator:
    """Merges rows per step and emits Arrow batches for `steps` and `metrics`."""

    def __init__(self, run_id: str, step_key: str, fix: SignalFix | None = None):
        self.run_id = run_id
        self.step_key = step_key
        self.fix = fix
        self.tables: list[tuple[int, str]] = []  # (step, file) of TRL completions tables
        self.pending: dict[int, dict[str, Any]] = {}
        self.keys: set[str] = set()
        self.skipped: set[str] = set()
        self.rows = 0
        self.unstepped = 0
        self.late = 0
        self.last_step: int | None = None
        self.metric_values = 0
        self.steps_written: set[int] = set()
        self.mapped: dict[str, str] = {}

    def add(self, row: Mapping[str, Any]) -> None:
        self.rows += 1
        step = _step_of(row, self.step_key)
        if step is None and self.step_key != "_step" and self.last_step is not None:
            # a row without the run's step key (e.g. a direct wandb.log next to TRL's logging): it belongs
            # to the latest optimizer step, as W&B's define_metric(step_sync=True) shows it
            step = self.last_step
        if step is None:
            self.unstepped += 1
            return
        self.last_step = step
        for k in COMPLETIONS_KEYS:
            ref = table_ref(k, row.get(k))
            if ref is not None:
                self.tables.append((step, ref))
        if step in self.steps_written:
            # already written (history not in step order after a drain): the store is append-only, so a
            # second row for the step would duplicate it. write_run only drains early on the `_step` axis,
            # where W&B returns rows in step order, so this only happens on malformed input.
            self.late += 1
            return
        merged = self.pending.setdefault(step, {})
        merged.update(row)

    def drain(self, final: bool = False) -> tuple[pa.Table | None, pa.Table | None]:
        """Tables for the steps buffered so far. Not final: keep the newest step (rows of one step may
        still be coming), everything older is complete in a time-ordered history."""
        if not self.pending:
            return None, None
        steps = sorted(self.pending)
        if not final:
            steps = steps[:-1]
        if not steps:
            return None, None
        m_step: list[int] = []
        m_key: list[str] = []
        m_val: list[float] = []
        sigs: list[dict[str, float]] = []
        s_time: list[float | None] = []
        keys, skipped = self.keys, self.skipped
        num = (int, float)
        for step in steps:
            row = self.pending.pop(step)
            for k, v in row.items():
                tv = type(v)
                if tv is float or tv is int or (isinstance(v, num) and tv is not bool):
                    if k == "_step":
                        continue
                    m_step.append(step)
                    m_key.append(k)
                    m_val.append(v)
                elif tv is bool:
                    m_step.append(step)
                    m_key.append(k)
                    m_val.append(1.0 if v else 0.0)
                elif v is not None:
                    skipped.add(k)
            keys.update(row.keys())
            sig = map_row(row)
            if self.fix is not None:
                self.fix(sig)
            sigs.append(sig)
            ts = row.get("_timestamp")
            s_time.append(float(ts) if type(ts) in num and math.isfinite(ts) else None)
        self.steps_written.update(steps)
        keys.difference_update(skipped)
        keys.discard("_step")
        self.metric_values += len(m_val)
        metrics = pa.table(
            {
                "step": pa.array(m_step, pa.int64()),
                "key": pa.array(m_key, pa.string()),
                "value": pa.array(np.asarray(m_val, dtype=np.float64), pa.float64()),
            }
        )
        present = {name for d in sigs for name in d}
        t_us = pa.array(
            [None if t is None else int(round(t * 1e6)) for t in s_time], pa.int64()
        ).cast(pa.timestamp("us", tz="UTC"))
        n = len(steps)
        steps_tbl = pa.table(
            {
                "step": pa.array(steps, pa.int64()),
                "time": t_us,
                "n_samples": pa.nulls(n, pa.int32()),
                **{
                    name: (pa.array([d.get(name) for d in sigs], pa.float64()) if name in present
                           else pa.nulls(n, pa.float64()))
                    for name in schema.STEP_SIGNALS
                },
            }
        )
        return steps_tbl, metrics


def write_run(
    store: str,
    spec: ImportSpec,
    history: Iterable[Mapping[str, Any]],
    *,
    mode: str | None = None,
    name: str | None = None,
    total_rows: int | None = None,
    progress: bool = True,
) -> ImportResult:
    """Write one W&B run into `store` (replacing an earlier import of the same run)."""
    t0 = time.perf_counter()
    run_id = store_run_id(spec.project, spec.wandb_id)
    history = iter(history)
    first_rows: list[Mapping[str, Any]] = []
    # peek a few rows to choose the step axis (TRL: train/global_step)
    for row in history:
        first_rows.append(row)
        if len(first_rows) >= 50:
            break
    profile = RunProfile.read(spec.config, {k for r in first_rows for k in r}, mode)
    run_name = name or spec.name or spec.wandb_id
    config = dict(spec.config)
    config["_lld_monitor_import"] = {
        "wandb_id": spec.wandb_id,
        "project": spec.project,
        "entity": spec.entity,
        "origin": spec.origin,
        "mode_reason": profile.mode_reason,
        "step_key": profile.step_key,
        "fixes": profile.fixes_done,
        "wandb_state": spec.status,
        "imported_at": datetime.now(tz=timezone.utc).isoformat(),
    }
    writer = RunWriter.create(
        store,
        run_name,
        profile.mode,
        source="wandb",
        config=config,
        model=_model_from_config(spec.config),
        run_id=run_id,
        overwrite=True,
    )
    if spec.started_at is not None:
        # when the run started on W&B, not when it was imported
        writer.update_run(started_at=spec.started_at.astimezone(timezone.utc).isoformat())
    acc = _Accumulator(run_id, profile.step_key, profile.fix)
    bar = _progress(total_rows, f"import {run_name}", progress)
    try:
        since = 0
        for row in _chain(first_rows, history):
            acc.add(row)
            since += 1
            if since >= BATCH_ROWS:
                if profile.step_key == "_step":  # W&B returns `_step` rows in order: older steps are complete
                    _append(writer, *acc.drain(final=False))
                bar.update(since)
                since = 0
        _append(writer, *acc.drain(final=True))
        extra_notes, summary_keys, n_samples = _append_summary_and_tables(writer, spec, acc)
        bar.update(since)
    except BaseException:
        bar.close()
        writer.finish(status="crashed")
        _restore_previous(writer)
        raise
    bar.close()
    _finish(writer, spec.status)
    t_det = time.perf_counter()
    problems = list(profile.notes) + extra_notes
    if not store_detector_replay(store, run_id):
        problems.append("the detector's replay could not be stored: the dashboard replays the run when it opens it")
    t_det = time.perf_counter() - t_det
    if acc.late:
        problems.append(f"{acc.late} history row(s) for already written steps were dropped")
    if acc.unstepped:
        problems.append(f"{acc.unstepped} history row(s) without a step were skipped")
    if acc.skipped:
        log.info("%s: non-numeric keys kept out of metrics: %s", run_name, sorted(acc.skipped))
    return ImportResult(
        run_id=run_id,
        name=run_name,
        mode=profile.mode,
        mode_reason=profile.mode_reason,
        family=profile.framework,
        rows=acc.rows,
        steps=len(acc.steps_written),
        metric_values=acc.metric_values,
        mapped=mapped_keys(acc.keys),
        skipped_keys=sorted(acc.skipped),
        status=spec.status,
        seconds=time.perf_counter() - t0,
        problems=problems,
        summary_keys=summary_keys,
        samples=n_samples,
        detector_seconds=t_det,
    )


def store_detector_replay(store: str, run_id: str) -> bool:
    """Replay the detector (with the run's forecast model, `detect.offline.run_model`) over the imported run and
    store its state beside the run (store/detector_cache.py): the dashboard, `detect` and `forecast` restore it
    instead of replaying a run that has no online checkpoints. False (logged) when it could not be stored."""
    from lld_monitor.detect.checkpoint import detect_resumed, replay_checkpoint
    from lld_monitor.store import open_store_reader
    from lld_monitor.store.detector_cache import write_detector_cache

    try:
        with open_store_reader(store) as reader:
            signals = reader.signals(run_id)
        if signals.empty:
            return True
        det, _ = detect_resumed(signals, None)  # forecast=AUTO: the model RunLogger's detector would choose
        return write_detector_cache(store, run_id, replay_checkpoint(det, signals)) is not None
    except Exception:  # noqa: BLE001 - the import itself is done; only the first look gets slower
        log.exception("detector replay of imported run %s not stored", run_id)
        return False


def _append_summary_and_tables(writer: Any, spec: ImportSpec, acc: _Accumulator) -> tuple[list[str], list[str], int]:
    """Summary-only scalars into `metrics` at the last step; TRL completions tables into `samples`."""
    notes: list[str] = []
    last = max(acc.steps_written) if acc.steps_written else 0
    extra = summary_only(spec.summary, acc.keys | acc.skipped)
    if extra:
        writer.append("metrics", pa.table({
            "step": pa.array([last] * len(extra), pa.int64()),
            "key": pa.array(list(extra), pa.string()),
            "value": pa.array(list(extra.values()), pa.float64()),
        }))
        acc.metric_values += len(extra)
    n = 0
    if acc.tables:
        cols, table_notes = completions_samples(acc.tables, reward_function_names(acc.keys))
        notes.extend(table_notes)
        if cols is not None:
            n = writer.append("samples", cols)
    return notes, sorted(extra), n


def _finish(writer: Any, wandb_status: str) -> None:
    """Close the imported run. The store's finish() takes 'finished' or 'crashed'; a W&B run that is still
    running is stored as a finished snapshot (its W&B state is kept in config._lld_monitor_import.wandb_state;
    re-import to refresh it). A run that crashed on W&B is stored as crashed."""
    status = "crashed" if wandb_status == "crashed" else "finished"
    writer.finish(status=status)
    if status == "crashed":
        # the import itself succeeded: the previous import of this run, set aside by overwrite=True,
        # is no longer needed (RunWriter only drops it after a 'finished' close)
        writer.discard_previous()


def _restore_previous(writer: Any) -> None:
    """A failed re-import must not lose the earlier import: put the run that overwrite=True set aside back (a folder
    moved aside, or a bucket's old manifests: RunWriter.restore_previous)."""
    if writer.restore_previous():
        log.warning("import of %s failed; the previous import was kept", writer.run_id)


def _append(writer: Any, steps_tbl: pa.Table | None, metrics: pa.Table | None) -> None:
    if steps_tbl is not None and steps_tbl.num_rows:
        writer.append("steps", steps_tbl)
    if metrics is not None and metrics.num_rows:
        writer.append("metrics", metrics)


def _chain(first: list[Mapping[str, Any]], rest: Iterator[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    yield from first
    yield from rest


class _NoBar:
    def update(self, n: int) -> None:  # noqa: D401
        pass

    def close(self) -> None:
        pass


def _progress(total: int | None, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc=desc, unit="row", leave=False, mininterval=0.5)


def config_json(config: Mapping[str, Any]) -> str:
    return json.dumps(config, default=str, allow_nan=True)
