"""RunLogger: the one object a training loop uses. `log_step` never waits on I/O.

On the caller's thread `log_step` only copies what it is given to CPU numpy (torch tensors are
detached and copied; torch itself is never imported here) and puts it on a bounded queue. A
background thread computes the step aggregates from all samples (`aggregates.step_aggregates`), builds
the Arrow batches for the steps / metrics / samples / tokens tables, hands each step to the sinks (the online
detector, added by default; the W&B exporter or your own: `sinks.py`) and flushes the store every
`flush_every_steps` steps or `flush_every_s` seconds, whichever comes first.

```python
with RunLogger("lld_runs", "my run", "vanilla", config) as log:
    for step in range(n):
        log.log_step(step, scalars={"grad_norm": g}, samples={...}, tokens={...})
```
An exception out of the `with` block, an unhandled exception in the main thread or SIGTERM marks the
run crashed (previous excepthook / SIGTERM handler still run); `close()` marks it finished.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .aggregates import derive_sample_columns, sample_sums_from_tokens, step_aggregates, to_numpy
from .detect import load_detector_config
from .detect.checkpoint import CHECKPOINT_EVERY
from .detect.forecast_model import AUTO, ForecastModel
from .detect.sink import DetectorSink
from .roles import ROLE_TOOL, ROLES
from .sinks import Sink, StepEvent
from .store import RunWriter, WriterConfig, schema
from .store.errors import WriterConflictError

log = logging.getLogger(__name__)

STEP_COLUMNS = frozenset(schema.STEP_SIGNALS) | {"n_samples"}
SAMPLE_COLUMNS = tuple(n for n in schema.SAMPLES.names if n not in ("run_id", "step", "rank"))
REQUIRED_SAMPLE_COLUMNS = ("reward", "advantage", "group_id")
TOKEN_COLUMNS = ("token_id", "mask", "role", "action_idx", "logp_old", "logp_new", "logp_ref", "entropy")
__all__ = ["LoggerOptions", "RunLogger", "step_aggregates", "derive_sample_columns", "sample_sums_from_tokens", "to_numpy", "to_float"]
_ROLES_ARROW = pa.array(list(ROLES), type=pa.string())
_STOP = object()


# ----------------------------------------------------------------------------- caller-thread copies
def to_float(value: Any, name: str = "scalar") -> float:
    """One float from a number, a 0-d / 1-element tensor or array (NaN and inf kept)."""
    if hasattr(value, "detach"):
        value = to_numpy(value)
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise ValueError(f"log_step: scalar {name!r} must be a single number, got shape {value.shape}")
        return float(value.reshape(-1)[0])
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"log_step: scalar {name!r} must be a number, got {type(value).__name__}") from e


def _copy_columns(cols: Mapping[str, Any] | None, what: str, allowed: Sequence[str]) -> dict[str, np.ndarray] | None:
    if cols is None:
        return None
    out: dict[str, np.ndarray] = {}
    for k, v in cols.items():
        if k not in allowed:
            raise ValueError(f"log_step: unknown {what} column {k!r}; allowed: {list(allowed)}")
        out[k] = to_numpy(v)
    return out


# ----------------------------------------------------------------------------- crash handlers
_LIVE: "weakref.WeakSet[RunLogger]" = weakref.WeakSet()
_HOOKS_INSTALLED = False
_PREV_EXCEPTHOOK: Any = None
_PREV_SIGTERM: Any = None


def _excepthook(exc_type, exc, tb) -> None:
    for lg in list(_LIVE):
        try:
            lg.close(status="crashed", timeout=10.0)
        except Exception:  # noqa: BLE001 - never mask the original error
            log.exception("could not mark run %s crashed", getattr(lg, "run_id", "?"))
    (_PREV_EXCEPTHOOK or sys.__excepthook__)(exc_type, exc, tb)


def _sigterm(signum, frame) -> None:
    for lg in list(_LIVE):
        try:
            lg._abort("crashed", timeout=5.0)
        except Exception:  # noqa: BLE001
            log.exception("could not mark run %s crashed", getattr(lg, "run_id", "?"))
    prev = _PREV_SIGTERM
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:  # default action: die of SIGTERM, as without us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _atexit() -> None:
    for lg in list(_LIVE):
        try:
            lg.close()
        except Exception:  # noqa: BLE001
            log.exception("could not close run %s at exit", getattr(lg, "run_id", "?"))


def _install_hooks() -> None:
    global _HOOKS_INSTALLED, _PREV_EXCEPTHOOK, _PREV_SIGTERM
    if _HOOKS_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    _PREV_EXCEPTHOOK = sys.excepthook
    sys.excepthook = _excepthook
    try:
        _PREV_SIGTERM = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _sigterm)
    except (ValueError, OSError):  # not allowed here (e.g. embedded interpreters)
        _PREV_SIGTERM = None
    atexit.register(_atexit)
    _HOOKS_INSTALLED = True


# ----------------------------------------------------------------------------- the logger
@dataclasses.dataclass(frozen=True)
class LoggerOptions:
    """Knobs a training loop rarely sets (tests and benchmarks do)."""

    queue_size: int = 256  # steps queued for the writer thread before log_step waits
    detector_checkpoint_every: int = CHECKPOINT_EVERY  # the online detector's state every N steps (detect/checkpoint.py)
    writer: WriterConfig | None = None  # segment compaction settings (store/writer.py)
    # the detector's collapse-forecast model; AUTO: $LLD_MONITOR_FORECAST_MODEL's, else the shipped one that fits the
    # first step's signals (detect.forecast_model.model_for); None: no forecast
    forecast: ForecastModel | str | None = AUTO


@dataclasses.dataclass
class _Item:
    step: int
    scalars: dict[str, float]
    samples: dict[str, np.ndarray] | None
    tokens: dict[str, np.ndarray] | None
    all_samples: dict[str, np.ndarray] | None


class RunLogger:
    """Log a training run into a store without blocking the training step. See the module docstring."""

    def __init__(
        self,
        store: str | os.PathLike,
        run_name: str,
        mode: str,
        config: dict | None = None,
        *,
        source: str = "local",
        model: str | None = None,
        run_id: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        token_every: int = 1,
        token_groups: int | None = None,
        vocab: Sequence[str] | None = None,
        detector: Any = True,
        sinks: Sequence[Sink] = (),
        flush_every_steps: int = 10,
        flush_every_s: float = 2.0,
        handle_signals: bool = True,
        options: LoggerOptions | None = None,
    ):
        """`detector`: True or None (the defaults, or $LLD_MONITOR_DETECTOR_CONFIG's file if set), False, or a config (a
        DetectorConfig, a mapping of overrides, or a JSON file as `lld-monitor detect --config` takes); a bad one
        fails here, before the run exists. `sinks` get every stored step after the detector (`sinks.py`).
        `handle_signals`: mark the run crashed on an unhandled exception or SIGTERM (main thread only)."""
        options = options or LoggerOptions()
        if flush_every_steps < 1 or flush_every_s <= 0 or token_every < 0:
            raise ValueError("flush_every_steps >= 1, flush_every_s > 0 and token_every >= 0 (0 = never) are required")
        if token_groups is not None and token_groups < 0:
            raise ValueError("token_groups must be None (all groups) or >= 0")
        bad = [s for s in sinks if not isinstance(s, Sink)]
        if bad:
            raise TypeError(f"sinks need on_step(event) and on_close(status) (lld_monitor.sinks.Sink); got {bad!r}")
        detector_sink = None
        if detector is not False and rank == 0:
            cfg = load_detector_config(None if detector is True or detector is None else detector)
            detector_sink = DetectorSink(cfg, checkpoint_every=options.detector_checkpoint_every,
                                         forecast=options.forecast)
        self.rank = rank
        self.flush_every_steps = flush_every_steps
        self.flush_every_s = flush_every_s
        self.token_every = token_every
        self.token_groups = token_groups
        self._vocab = None if vocab is None else pa.array([str(v) for v in vocab], type=pa.string())
        self._writer = RunWriter.create(
            store, run_name, mode, source=source, config=config, model=model, run_id=run_id,
            rank=rank, world_size=world_size, writer_config=options.writer,
        )
        self.run_id = self._writer.run_id
        # first use of Arrow's compute kernels costs ~0.5 s: pay it here, not inside a step
        _ROLES_ARROW.take(pa.array([0]))
        pa.repeat(pa.scalar("x"), 2)
        self._detector = detector_sink
        self._sinks: list[Sink] = ([detector_sink] if detector_sink is not None else []) + (list(sinks) if rank == 0 else [])
        self._q: queue.Queue = queue.Queue(maxsize=options.queue_size)
        self._abort_status: str | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self.errors = 0
        self.steps_logged = 0
        self._warned_rank_scalars = False
        self._conflict = False
        self._thread = threading.Thread(target=self._loop, name=f"RunLogger[{self.run_id}:{rank}]", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        if handle_signals:
            _install_hooks()

    @property
    def phase(self) -> str | None:
        """The online detector's phase after the last step it processed (None without a detector)."""
        return self._detector.phase if self._detector is not None else None

    # ------------------------------------------------------------------ caller side
    def log_step(
        self,
        step: int,
        scalars: Mapping[str, Any] | None = None,
        samples: Mapping[str, Any] | None = None,
        tokens: Mapping[str, Any] | None = None,
        all_samples: Mapping[str, Any] | None = None,
    ) -> None:
        """Copy the inputs to CPU numpy and queue them; returns at once (blocks only if the queue is full)."""
        if self._closed:
            raise RuntimeError(f"RunLogger for run {self.run_id!r} is closed")
        sc = {str(k): to_float(v, str(k)) for k, v in (scalars or {}).items()}
        sm = _copy_columns(samples, "samples", SAMPLE_COLUMNS)
        tk = _copy_columns(tokens, "tokens", TOKEN_COLUMNS)
        al = _copy_columns(all_samples, "all_samples", SAMPLE_COLUMNS)
        n = None
        for what, cols in (("samples", sm), ("all_samples", al)):
            if cols is None:
                continue
            missing = [c for c in REQUIRED_SAMPLE_COLUMNS if c not in cols]
            if missing:
                raise ValueError(f"log_step: {what} needs columns {list(REQUIRED_SAMPLE_COLUMNS)}; missing {missing}")
            lens = {k: (len(v) if v.ndim else 1) for k, v in cols.items()}
            if len(set(lens.values())) > 1:
                raise ValueError(f"log_step: {what} columns differ in length: {lens}")
            if what == "samples":
                n = next(iter(lens.values()))
        if tk is not None:
            if sm is None:
                raise ValueError("log_step: tokens need the matching samples (rows of tokens = rows of samples)")
            if "token_id" not in tk:
                raise ValueError("log_step: tokens need a 'token_id' [N, T] array")
            shape = tk["token_id"].shape
            bad = {k: v.shape for k, v in tk.items() if v.shape != shape}
            if len(shape) != 2 or shape[0] != n or bad:
                raise ValueError(f"log_step: token arrays must all be [N={n}, T]; token_id is {shape}, others {bad}")
        item = _Item(int(step), sc, sm, tk, al)
        try:
            self._q.put_nowait(item)
        except queue.Full:
            t0 = time.perf_counter()
            self._q.put(item)
            log.warning("RunLogger queue full: log_step waited %.3f s for the writer thread", time.perf_counter() - t0)

    # ------------------------------------------------------------------ writer thread
    def _loop(self) -> None:
        last_flush = time.monotonic()
        pending = 0
        while True:
            wait = max(0.0, last_flush + self.flush_every_s - time.monotonic())
            try:
                if self._abort_status is not None:
                    item = self._q.get_nowait()
                else:
                    item = self._q.get(timeout=min(wait, 0.5) if wait > 0 else 0.001)
            except queue.Empty:
                if self._abort_status is not None:
                    self._close_sinks()
                    return  # drained after SIGTERM; the handler finishes the writer
                item = None
            if item is _STOP:
                self._close_sinks()
                self._q.task_done()
                return
            if item is not None:
                try:
                    self._process(item)
                except Exception:  # noqa: BLE001 - keep training; say what was lost
                    self.errors += 1
                    log.exception("run %s: could not log step %s (dropped)", self.run_id, item.step)
                finally:
                    self._q.task_done()
                pending += 1
            now = time.monotonic()
            if pending >= self.flush_every_steps or now - last_flush >= self.flush_every_s:
                try:
                    self._writer.flush()
                except WriterConflictError as e:  # said once: every later flush is refused the same way
                    self.errors += 1
                    if not self._conflict:
                        self._conflict = True
                        log.error("run %s: %s", self.run_id, e)
                except Exception:  # noqa: BLE001
                    self.errors += 1
                    log.exception("run %s: flush failed; will retry", self.run_id)
                last_flush, pending = now, 0

    def _process(self, it: _Item) -> None:
        w = self._writer
        samples = it.samples
        if samples is not None and it.tokens is not None:
            derived = sample_sums_from_tokens(it.tokens)
            samples = {**{k: v for k, v in derived.items()}, **samples}
        if samples is not None:
            samples = derive_sample_columns(samples)
        signals: dict[str, float] = {}
        if self.rank == 0:
            agg_src = it.all_samples if it.all_samples is not None else samples
            row: dict[str, Any] = step_aggregates(agg_src) if agg_src is not None else {}
            metrics = {}
            for k, v in it.scalars.items():
                if k in STEP_COLUMNS:
                    row[k] = int(v) if k == "n_samples" and math.isfinite(v) else v
                else:
                    metrics[k] = v
            w.append("steps", {"step": [it.step], **{k: [v] for k, v in row.items()}})
            if metrics:
                w.append("metrics", {"step": np.full(len(metrics), it.step), "key": list(metrics),
                                     "value": np.array(list(metrics.values()), dtype=np.float64)})
            signals = {k: float(v) for k, v in row.items() if v is not None and k != "n_samples"}
            signals.update(metrics)
        elif it.scalars and not self._warned_rank_scalars:
            log.warning("rank %d: scalars are rank 0's to log; ignoring them on this rank", self.rank)
            self._warned_rank_scalars = True
        if samples is not None:
            n = len(samples["reward"])
            cols = {k: v for k, v in samples.items() if k in SAMPLE_COLUMNS}
            cols.setdefault("sample_idx", np.arange(n, dtype=np.int32))
            w.append("samples", {"step": np.full(n, it.step), **cols})
            if it.tokens is not None and self._token_step(it.step):
                self._append_tokens(it.step, cols, it.tokens)
        if self.rank == 0:
            self._run_sinks(StepEvent(it.step, signals))
        self.steps_logged += 1

    def _run_sinks(self, event: StepEvent) -> None:
        """Hand the step to each sink in turn; store what they raised (alerts) and recorded (their rows)."""
        for sink in list(self._sinks):
            try:
                sink.on_step(event)
            except Exception:  # noqa: BLE001
                log.exception("sink %s failed at step %d; dropped for run %s", type(sink).__name__, event.step,
                              self.run_id)
                self._drop(sink)
        for table, cols in event.records:
            self._writer.append(table, cols)
        if event.alerts:
            recs = [schema.alert_record(a) for a in event.alerts]
            self._writer.append("alerts", {c: [r[c] for r in recs] for c in schema.ALERT_COLUMNS})

    def _drop(self, sink: Sink) -> None:
        self._sinks.remove(sink)
        if sink is self._detector:
            self._detector = None

    def _close_sinks(self) -> None:
        """Each sink's last records (the detector's final checkpoint), in the writer thread before the run ends."""
        status = self._abort_status or "finished"
        for sink in list(self._sinks):
            try:
                for table, cols in sink.on_close(status) or []:
                    self._writer.append(table, cols)
            except Exception:  # noqa: BLE001 - the run's data matters more than a sink's last word
                log.exception("run %s: sink %s failed at close", self.run_id, type(sink).__name__)

    def _token_step(self, step: int) -> bool:
        return self.token_every > 0 and step % self.token_every == 0 and self.token_groups != 0

    def _append_tokens(self, step: int, samples: dict[str, np.ndarray], tok: dict[str, np.ndarray]) -> None:
        ids = tok["token_id"]
        n, t = ids.shape
        keep_rows = np.ones(n, dtype=bool)
        if self.token_groups is not None:
            groups = samples["group_id"]
            _, first = np.unique(groups, return_index=True)
            chosen = groups[np.sort(first)[: self.token_groups]]
            keep_rows = np.isin(groups, chosen)
        mask = tok["mask"].astype(bool) if "mask" in tok else np.ones((n, t), dtype=bool)
        mask &= keep_rows[:, None]
        r, c = np.nonzero(mask)
        if r.size == 0:
            return
        role = tok["role"][r, c].astype(np.int64) if "role" in tok else np.zeros(r.size, dtype=np.int64)
        if role.size and (role.min() < 0 or role.max() >= len(ROLES)):
            raise ValueError(f"token roles must be codes 0..{len(ROLES) - 1} ({ROLES})")
        tool = role == ROLE_TOOL
        tid = ids[r, c].astype(np.int64)
        # strings via Arrow `take` (C++, no per-token Python objects: the caller thread keeps the GIL)
        cols: dict[str, Any] = {
            "step": np.full(r.size, step),
            "sample_idx": samples["sample_idx"][r].astype(np.int32),
            "position": c.astype(np.int32),
            "token_id": tid.astype(np.int32),
            "role": _ROLES_ARROW.take(pa.array(role)),
        }
        if self._vocab is not None:
            inside = (tid >= 0) & (tid < len(self._vocab))
            idx = pa.array(np.where(inside, tid, 0), mask=~inside)
            cols["token_text"] = self._vocab.take(idx)
        if "action_idx" in tok:
            cols["action_idx"] = np.where(tool, -1, tok["action_idx"][r, c]).astype(np.int32)
        for k in ("logp_old", "logp_new", "logp_ref", "entropy"):
            if k in tok:
                vals = tok[k][r, c].astype(np.float32)
                cols[k] = pa.array(vals, mask=tool, type=pa.float32())  # tool tokens: NULL, NaN stays NaN
        self._writer.append("tokens", cols)

    # ------------------------------------------------------------------ ending
    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything logged so far is processed and visible to readers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._q.unfinished_tasks > 0 and self._thread.is_alive():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("RunLogger.flush: writer thread still busy")
            time.sleep(0.005)
        self._writer.flush()

    def close(self, status: str = "finished", timeout: float | None = None) -> None:
        """Process everything queued, flush, compact, mark the run `status`. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._thread.is_alive():
                self._q.put(_STOP, timeout=timeout)
                self._thread.join(timeout)
        finally:
            self._writer.finish(status, timeout=timeout)
            _LIVE.discard(self)
            if self.errors:
                log.warning("run %s closed with %d logging error(s); see the log above", self.run_id, self.errors)

    def _abort(self, status: str, timeout: float) -> None:
        """Signal-handler path: no queue locks (the interrupted frame may hold them)."""
        if self._closed:
            return
        self._closed = True
        self._abort_status = status
        self._thread.join(timeout)
        self._writer.finish(status, timeout=timeout)
        _LIVE.discard(self)

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("crashed" if exc_type is not None else "finished")
