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


# ---------------------------------------------------------------------------------------------
# fingerprints: one sha256 per run, what a rerun on another machine must reproduce
# ---------------------------------------------------------------------------------------------
def _column_bytes(col: pd.Series) -> bytes:
    import numpy as np

    kind = getattr(col.dtype, "kind", "O")
    if kind == "f":
        a = col.astype("float64").to_numpy(dtype="float64", na_value=np.nan).copy()
        a[np.isnan(a)] = np.nan  # one NaN bit pattern
        return a.astype("<f8").tobytes()
    if kind in "iub":
        na = col.isna().to_numpy()
        a = col.astype("float64" if na.any() else "int64").to_numpy()
        return na.tobytes() + np.asarray(a).astype("<f8" if na.any() else "<i8").tobytes()
    return "\x1f".join("\x00NA" if v is None or v is pd.NA or (isinstance(v, float) and v != v) else str(v)
                       for v in col.tolist()).encode("utf-8")


def _frame_digest(h, what: str, df: pd.DataFrame, keys: list[str]) -> None:
    df = df.sort_values([k for k in keys if k in df.columns], kind="stable").reset_index(drop=True)
    h.update(f"{what}:{len(df)}\n".encode())
    for c in sorted(df.columns):
        h.update(f"{c}\n".encode())
        h.update(_column_bytes(df[c]))


def _run_tables(reader: StoreReader, run_id: str, steps: int | None):
    """(name, frame, sort keys) of what a run computed in its first `steps` steps, wall clock left out."""

    def head(df: pd.DataFrame) -> pd.DataFrame:
        return df if steps is None else df[df.step < steps]

    yield "steps", head(reader.steps(run_id)).drop(columns=["run_id", *WALL_CLOCK_STEP_COLUMNS], errors="ignore"), ["step"]
    m = head(reader.metrics(run_id))
    yield "metrics", m[~m.key.str.startswith(WALL_CLOCK_METRIC_PREFIX)].drop(columns=["run_id"], errors="ignore"), [
        "step", "key"]
    yield "samples", head(reader.samples(run_id)).drop(columns=["run_id"], errors="ignore"), ["step", "rank", "sample_idx"]
    for st in reader.token_steps(run_id):
        if steps is None or st < steps:
            yield f"tokens@{st}", reader.tokens(run_id, st).drop(columns=["run_id"], errors="ignore"), [
                "rank", "sample_idx", "position"]


def run_fingerprint(reader: StoreReader, run_id: str, steps: int | None = None) -> str:
    """sha256 over what a run computed in its first `steps` steps (None: all): every step row, metric,
    sample and logged token, wall-clock columns and the run id left out (the same as `run_differences`
    compares). Two runs have the same fingerprint exactly when they are the same run, bit for bit."""
    import hashlib

    h = hashlib.sha256()
    for what, df, keys in _run_tables(reader, run_id, steps):
        _frame_digest(h, what, df, keys)
    return h.hexdigest()


def step_digests(reader: StoreReader, run_id: str, steps: int | None = None) -> dict[str, dict[str, str]]:
    """What `run_fingerprint` hashes, one short digest per step and column: {step: {"steps.grad_norm": ...,
    "metrics.actor/ppo_kl": ..., "samples.reward": ..., "tokens.logp_new": ...}}, so that two runs whose
    fingerprints differ can be told apart at the first step and column that differ (`first_difference`)."""
    import hashlib

    out: dict[str, dict[str, str]] = {}

    def put(step: int, name: str, payload: bytes) -> None:
        out.setdefault(str(int(step)), {})[name] = hashlib.sha256(payload).hexdigest()[:12]

    for what, df, keys in _run_tables(reader, run_id, steps):
        table = what.split("@")[0]
        df = df.sort_values([k for k in keys if k in df.columns], kind="stable").reset_index(drop=True)
        if table == "tokens":
            step = int(what.split("@")[1])
            for c in sorted(df.columns):
                put(step, f"tokens.{c}", _column_bytes(df[c]))
            continue
        for step, part in df.groupby("step", sort=True):
            if table == "metrics":
                for key, row in part.groupby("key", sort=True):
                    put(step, f"metrics.{key}", _column_bytes(row["value"]))
            else:
                for c in sorted(part.columns):
                    put(step, f"{table}.{c}", _column_bytes(part[c]))
    return out


def first_difference(got: dict[str, dict[str, str]], want: dict[str, dict[str, str]]) -> str | None:
    """The first step and column where two `step_digests` differ, in words (None: no difference)."""
    for step in sorted(set(got) | set(want), key=int):
        a, b = got.get(step, {}), want.get(step, {})
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                what = "missing here" if name not in a else "not in the reference" if name not in b else "differs"
                return f"step {step}, {name} ({what})"
    return None
