"""The post-mortem's "most displaced preserved samples" per phase band (queries.top_displaced_samples, one DuckDB
top-k per band) equal a brute-force pandas ranking: ties, a phase that recurs, runs with and without token rows,
and another run's samples in the same store."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lld_monitor.store import RunWriter, open_store_reader
from lld_monitor.ui import queries

BANDS = pd.DataFrame({"phase": ["healthy", "decay", "healthy", "collapsed"],
                      "start": [0, 10, 20, 30], "end": [9, 19, 29, 39]})


def _write(store, name: str, seed: int, token_steps: list[int]) -> str:
    rng = np.random.default_rng(seed)
    w = RunWriter.create(store, name, "vanilla", run_id=name)
    for step in range(40):
        n = 12
        delta = np.round(rng.normal(-0.5, 0.5, n), 1)  # rounded: many exact ties
        w.append("samples", {"step": np.full(n, step), "sample_idx": np.arange(n), "group_id": ["g"] * n,
                             "reward": rng.integers(0, 2, n).astype(float),
                             "advantage": np.where(rng.random(n) < 0.3, -1.0, rng.choice([0.0, 0.5, 1.0], n)),
                             "correct": rng.random(n) < 0.5,
                             "delta_sum": np.where(rng.random(n) < 0.1, np.nan, delta),
                             "delta_mean": delta / 10})
        if step in token_steps:
            w.append("tokens", {"step": [step], "sample_idx": [0], "position": [0], "token_id": [1],
                                "role": ["action"], "action_idx": [0], "logp_old": [-1.0], "logp_new": [-1.0]})
    w.finish()
    return name


def _brute_force(samples: pd.DataFrame, token_steps: list[int], k: int) -> pd.DataFrame:
    rows = []
    ends = list(BANDS["end"][:-1]) + [int(BANDS["end"].iloc[-1]) + 1]
    for (_, b), hi in zip(BANDS.iterrows(), ends):
        s = samples[(samples["step"] >= b["start"]) & (samples["step"] < hi) & (samples["advantage"] >= 0)
                    & samples["delta_sum"].notna()]
        if token_steps:
            s = s[s["step"].isin(token_steps)]
        s = s.sort_values(["delta_sum", "step", "rank", "sample_idx"]).head(k)
        rows.append(s.assign(phase=b["phase"]))
    return pd.concat(rows, ignore_index=True)


@pytest.mark.parametrize("token_steps", [[], [3, 5, 12, 13, 14, 22, 35, 36]])
@pytest.mark.parametrize("k", [1, 3, 50])
def test_top_displaced_samples_equal_a_brute_force_ranking(tmp_path, token_steps, k):
    rid = _write(tmp_path, "run", 1, token_steps)
    _write(tmp_path, "other", 2, [])  # another run's samples must not leak in
    with open_store_reader(tmp_path) as r:
        got = queries.top_displaced_samples(r, rid, BANDS, k=k)
        want = _brute_force(r.samples(rid), token_steps, k)
    cols = ["phase", "step", "rank", "sample_idx", "delta_sum", "advantage", "reward", "correct"]
    assert len(got) == len(want) > 0
    pd.testing.assert_frame_equal(got[cols].reset_index(drop=True), want[cols].reset_index(drop=True),
                                  check_dtype=False)
    assert got["has_tokens"].tolist() == [s in token_steps for s in got["step"]]
