"""What RunLogger hands to its sinks: one `StepEvent` per stored step row, and the `Sink` protocol.

A sink is anything that wants every step as it is stored: the online detector (`detect.sink.DetectorSink`,
which RunLogger adds itself), the W&B exporter (`integrations.wandb.export.WandbExporter`), or your own.
Sinks run in RunLogger's writer thread, on rank 0, in the order given, after the step's rows are queued for
the store; a sink that raises is logged and dropped, and training goes on.

```python
class PrintReward:
    def on_step(self, event):
        print(event.step, event.signals.get("reward_mean"))

    def on_close(self, status):
        return None

RunLogger("lld_runs", "run", "vanilla", sinks=[PrintReward()])
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class StepEvent:
    """One stored step. A sink may add to `alerts` (later sinks and the store's `alerts` table see them) and to
    `records` ((table, columns) pairs the logger appends to the run, as `RunWriter.append` takes them), and put
    what it computed in `derived` for the sinks after it."""

    step: int
    signals: Mapping[str, float]  # the step row's signals and every other scalar of the step, by name
    alerts: list[Any] = field(default_factory=list)  # detect.Alert objects raised at this step
    records: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    derived: dict[str, float] = field(default_factory=dict)  # what a sink computed, e.g. the detector's p_collapse


@runtime_checkable
class Sink(Protocol):
    def on_step(self, event: StepEvent) -> None:
        """Called once per stored step row (rank 0, writer thread)."""

    def on_close(self, status: str) -> list[tuple[str, dict[str, Any]]] | None:
        """Called once before the run is marked `status`; may return last records to store."""
