"""The online detector as a RunLogger sink: phases and alerts as the run is written, with checkpoints.

Every step row goes through the detector (a row without signals is no update, but a reader's replay sees it
too: the checkpoint digest covers exactly the rows stored). Its alerts go into the step's event (so later
sinks, the W&B exporter for one, see them, and the store's `alerts` table gets them); every
`checkpoint_every` steps, and at the end, its state goes to the `detector_state` table, so a reader replays
only the steps after the last checkpoint (`detect.checkpoint`).
"""

from __future__ import annotations

import logging
from typing import Any

from lld_monitor.sinks import StepEvent

from .checkpoint import CHECKPOINT_EVERY, CheckpointRecorder
from .config import DetectorConfig
from .forecast_model import AUTO, ForecastModel
from .online import OnlineDetector

log = logging.getLogger(__name__)


class DetectorSink:
    """`OnlineDetector(config, forecast)` fed every stored step, its state checkpointed every `checkpoint_every`
    steps; its latest p_collapse goes into the step's event (`derived["p_collapse"]`) for the sinks after it.
    `forecast`: a model, None (no forecast) or AUTO (`detect.forecast_model.model_for` the first row)."""

    def __init__(self, config: DetectorConfig | None = None, checkpoint_every: int = CHECKPOINT_EVERY,
                 forecast: ForecastModel | str | None = AUTO):
        self.detector = OnlineDetector(config, forecast)
        self.recorder = CheckpointRecorder(self.detector, every=checkpoint_every)

    @property
    def phase(self) -> str:
        """The detector's current phase."""
        return self.detector.phase

    def on_step(self, event: StepEvent) -> None:
        event.alerts.extend(self.recorder.update(event.step, event.signals))
        p = self.detector.p_collapse
        if p is not None:
            event.derived["p_collapse"] = p
        if self.recorder.due:
            event.records.append(("detector_state", self.recorder.checkpoint()))

    def on_close(self, status: str) -> list[tuple[str, dict[str, Any]]] | None:
        """The state after the last step, if it changed since the last checkpoint."""
        return [("detector_state", self.recorder.checkpoint())] if self.recorder.pending else None
