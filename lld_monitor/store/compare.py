"""Compare two stored runs value for value: is a rerun bit-for-bit the same run?

Used by `scripts/make_sample_runs.py --check` and the reproducibility test. Wall-clock columns are
measurements, not results of the run, and are left out: the step row's `time` and `step_time`, the
`timing_s/*` metrics. Everything else (every step signal, every metric, every sample with its text,
every logged token) must be equal, NaN equal to NaN, with no tolerance.
"""

from __future__ import annotations

import pandas as pd

from .reader import StoreReader

WALL_CLOCK_STEP_COLUMNS = ("time", "step_time")
WALL_CLOCK_METRIC_PREFIX = "timing_s/"


def _frame_differences(what: str, a: pd.DataFrame, b: pd.DataFrame) -> list[str]:
    if a.shape != b.shape or list(a.columns) != list(b.columns):
        return [f"{what}: shape {a.shape} vs {b.shape}" if a.shape != b.shape else f"{what}: columns differ"]
    out = []
    for col in a.columns:
        if not a[col].equals(b[col]):
            diff = ~((a[col] == b[col]) | (a[col].isna() & b[col].isna()))
            first = int(diff.to_numpy().argmax())
            out.append(f"{what}.{col}: {int(diff.sum())} of {len(a)} rows differ (first at row {first}: "
                       f"{a[col].iloc[first]!r} vs {b[col].iloc[first]!r})")
    return out


def run_differences(ra: StoreReader, run_a: str, rb: StoreReader, run_b: str, token_steps: int | None = None) -> list[str]:
    """What differs between run `run_a` in `ra` and run `run_b` in `rb` ([] = the same run, bit for bit).

    `token_steps` limits the token comparison to the first that many logged token steps (None = all).
    """
    out: list[str] = []
    sa = ra.steps(run_a).drop(columns=["run_id", *WALL_CLOCK_STEP_COLUMNS], errors="ignore").reset_index(drop=True)
    sb = rb.steps(run_b).drop(columns=["run_id", *WALL_CLOCK_STEP_COLUMNS], errors="ignore").reset_index(drop=True)
    out += _frame_differences("steps", sa, sb)
    ma, mb = (m[~m.key.str.startswith(WALL_CLOCK_METRIC_PREFIX)].drop(columns=["run_id"], errors="ignore")
              .sort_values(["step", "key"]).reset_index(drop=True) for m in (ra.metrics(run_a), rb.metrics(run_b)))
    out += _frame_differences("metrics", ma, mb)
    pa, pb = (s.drop(columns=["run_id"]).reset_index(drop=True) for s in (ra.samples(run_a), rb.samples(run_b)))
    out += _frame_differences("samples", pa, pb)
    ta, tb = ra.token_steps(run_a), rb.token_steps(run_b)
    if ta != tb:
        out.append(f"tokens: logged at steps {ta[:5]}... vs {tb[:5]}...")
    for st in ta[:token_steps] if token_steps is not None else ta:
        xa, xb = (t.drop(columns=["run_id"]).reset_index(drop=True) for t in (ra.tokens(run_a, st), rb.tokens(run_b, st)))
        out += _frame_differences(f"tokens@{st}", xa, xb)
    return out
