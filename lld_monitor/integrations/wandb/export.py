"""Send lld-monitor step signals and alerts to an active W&B run, so W&B dashboards keep working.

A RunLogger sink (`lld_monitor.sinks`): ``RunLogger(..., sinks=[WandbExporter(wandb.run)])`` hands it every
step from its writer thread after the step is stored, with the alerts the online detector raised at it; the
training loop never waits on W&B.

What is logged (all under the ``lld/`` prefix, so nothing collides with the trainer's own keys):
- ``lld/<signal>`` for every step signal and extra scalar of the step, against the x-axis ``lld/step``
  (declared with ``define_metric``; we never pass ``step=`` to ``run.log``, so the trainer's own step
  counter is never disturbed);
- ``lld/phase`` (index into ``schema.PHASES``; the detector's current phase), ``lld/alerts_total``;
- ``lld/p_collapse``: the detector's forecast (the chance the reward collapses within its horizon), from the step's
  event as the online detector computed it;
- ``lld/alerts``: a table of every alert so far (re-logged only when a new alert arrives);
- with ``notify=True``: ``run.alert(...)`` for critical alerts (W&B e-mail / Slack), at most one per
  ``notify_every_s`` seconds.

`import-wandb` maps ``lld/<signal>`` straight back onto the store's step signals (`signals.map_row`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from lld_monitor.signals import EXPORT_PREFIX
from lld_monitor.sinks import StepEvent
from lld_monitor.store.schema import ALERT_COLUMNS, PHASES, alert_record

log = logging.getLogger(__name__)

PREFIX = EXPORT_PREFIX


class WandbExporter:
    """Forward signals and alerts to `run` (a `wandb.Run`, or anything with `.log`)."""

    def __init__(self, run: Any, *, prefix: str = PREFIX, notify: bool = False, notify_every_s: float = 600.0):
        if run is None or not hasattr(run, "log"):
            raise ValueError("WandbExporter needs an active wandb run (the object wandb.init() returned)")
        self.run = run
        self.prefix = prefix
        self.notify = notify
        self.notify_every_s = notify_every_s
        self._last_notify = -math.inf
        self._alerts: list[dict[str, Any]] = []
        self.steps_sent = 0
        define = getattr(run, "define_metric", None)
        if callable(define):
            try:
                define(f"{prefix}step", hidden=True)
                define(f"{prefix}*", step_metric=f"{prefix}step")
            except Exception:  # noqa: BLE001 - an old SDK or a stand-in: the values are still logged
                log.debug("define_metric failed; lld/* keys use W&B's default x-axis", exc_info=True)

    def log_step(self, step: int, signals: Mapping[str, float], alerts: Iterable[Any] | None = None) -> None:
        data: dict[str, Any] = {f"{self.prefix}step": int(step)}
        for k, v in signals.items():
            if v is None:
                continue
            try:
                data[f"{self.prefix}{k}"] = float(v)
            except (TypeError, ValueError):
                continue
        new_alerts = [alert_record(a) for a in (alerts or [])]
        if new_alerts:
            self._alerts.extend(new_alerts)
            phase = new_alerts[-1].get("phase")
            if phase in PHASES:
                data[f"{self.prefix}phase"] = PHASES.index(phase)
            data[f"{self.prefix}alerts_total"] = len(self._alerts)
            table = self._table()
            if table is not None:
                data[f"{self.prefix}alerts"] = table
        self.run.log(data)
        self.steps_sent += 1
        if new_alerts:
            self._maybe_notify(new_alerts)

    def log_alerts(self, alerts: Iterable[Any], step: int | None = None) -> None:
        """Alerts raised outside a step (e.g. an offline detector pass)."""
        alerts = list(alerts)
        if not alerts:
            return
        last = step if step is not None else int(alert_record(alerts[-1]).get("step") or 0)
        self.log_step(last, {}, alerts)

    def _table(self) -> Any:
        try:
            import wandb  # noqa: PLC0415
        except ImportError:  # pragma: no cover
            return None
        rows = [[a.get(c) for c in ALERT_COLUMNS] for a in self._alerts]
        return wandb.Table(columns=list(ALERT_COLUMNS), data=rows)

    def _maybe_notify(self, alerts: list[dict[str, Any]]) -> None:
        if not self.notify or not hasattr(self.run, "alert"):
            return
        crit = [a for a in alerts if a.get("severity") == "critical"]
        now = time.monotonic()
        if not crit or now - self._last_notify < self.notify_every_s:
            return
        a = crit[-1]
        try:
            self.run.alert(title=f"LLD: {a.get('signal')} at step {a.get('step')}", text=str(a.get("message")),
                           level="ERROR")
            self._last_notify = now
        except Exception:  # noqa: BLE001
            log.warning("wandb run.alert failed", exc_info=True)

    # ---------------------------------------------------------------- as a RunLogger sink
    def on_step(self, event: StepEvent) -> None:
        self.log_step(event.step, {**event.signals, **event.derived}, event.alerts)

    def on_close(self, status: str) -> None:
        return None


__all__ = ["WandbExporter", "PREFIX"]
