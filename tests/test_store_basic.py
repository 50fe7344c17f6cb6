"""Round trips through RunWriter / StoreReader / RunLogger (in-process)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lld_monitor.logger import RunLogger, step_aggregates
from lld_monitor.store import RunWriter, StoreError, open_store_reader, schema


def _samples(n: int, rng: np.random.Generator) -> dict:
    return {"reward": (rng.random(n) > 0.5).astype(float), "advantage": rng.normal(size=n),
            "group_id": np.repeat(np.arange(n // 4), 4)}


def test_writer_reader_round_trip(tmp_path):
    w = RunWriter.create(tmp_path / "s", "plain", "vanilla", config={"lr": 1e-3})
    for s in range(25):
        w.append("steps", {"step": [s], "reward_mean": [s / 10], "n_samples": [8]})
        w.append("metrics", {"step": [s, s], "key": ["a/b", "c"], "value": [s, -s]})
        w.append("samples", {"step": [s] * 8, "sample_idx": range(8), "reward": np.ones(8), "group_id": ["g"] * 8})
        w.flush()
    r = open_store_reader(tmp_path / "s")
    row = r.run("plain")
    assert row["status"] == "running" and row["steps"] == 25 and row["last_step"] == 24
    w.finish()
    runs = r.runs()
    assert list(runs.columns)[: len(schema.RUNS.names)] == list(schema.RUNS.names)
    assert runs.loc[0, "status"] == "finished"
    steps = r.steps(w.run_id)
    assert steps["step"].tolist() == list(range(25))
    assert steps["reward_mean"].tolist() == pytest.approx([s / 10 for s in range(25)])
    assert len(r.samples(w.run_id)) == 200 and len(r.samples(w.run_id, step=3)) == 8
    sig = r.signals(w.run_id)
    assert sig["a/b"].tolist() == list(range(25)) and "reward_mean" in sig
    assert r.metrics(w.run_id, keys=["c"])["value"].tolist() == [-s for s in range(25)]
    # final compaction: one file per table
    assert len(list((w.path / "steps").glob("*.parquet"))) == 1
    assert r.sql("SELECT count(*) AS n FROM samples WHERE run_id = ?", [w.run_id])["n"][0] == 200


def test_unknown_column_and_table_are_errors(tmp_path):
    w = RunWriter.create(tmp_path / "s", "x", "vanilla")
    with pytest.raises(StoreError, match="unknown column"):
        w.append("steps", {"step": [0], "not_a_signal": [1.0]})
    with pytest.raises(StoreError, match="unknown table"):
        w.append("nope", {"step": [0]})
    with pytest.raises(StoreError, match="cannot be stored"):
        w.append("samples", {"step": [0], "n_actions": [1.5]})
    w.finish()


def test_logger_round_trip_with_tokens(tmp_path):
    rng = np.random.default_rng(0)
    n, t = 8, 12
    with RunLogger(tmp_path / "s", "lg", "llds", {"k": 1}, token_every=2, token_groups=1, handle_signals=False,
                   vocab=[f"w{i}" for i in range(50)], flush_every_steps=3, detector=False) as lg:
        for step in range(6):
            role = np.zeros((n, t), int)
            role[:, 4:6] = 1
            lg.log_step(step, scalars={"grad_norm": 2.0, "custom": 1.5}, samples=_samples(n, rng), tokens={
                "token_id": rng.integers(0, 50, (n, t)), "mask": np.ones((n, t), bool), "role": role,
                "logp_old": np.full((n, t), -1.0), "logp_new": np.full((n, t), -1.5)})
    r = open_store_reader(tmp_path / "s")
    steps = r.steps(lg.run_id)
    assert len(steps) == 6 and (steps["grad_norm"] == 2.0).all() and (steps["n_samples"] == 8).all()
    assert r.token_steps(lg.run_id) == [0, 2, 4]
    tok = r.tokens(lg.run_id, 0)
    assert len(tok) == 4 * t  # one group of 4 samples
    assert tok["logp_old"].isna().sum() == 4 * 2  # tool tokens carry NULL log-probs
    smp = r.samples(lg.run_id, step=0)
    assert smp["n_action_tokens"].tolist() == [t - 2] * n
    assert smp["delta_sum"].tolist() == pytest.approx([-0.5 * (t - 2)] * n)
    assert steps["delta_preserved"].iloc[0] == pytest.approx(-0.5 * (t - 2))
    assert r.run(lg.run_id)["status"] == "finished"


def test_step_aggregates_definitions():
    s = {"reward": np.array([1.0, 0.0, 1.0, 0.0]), "advantage": np.array([1.0, -1.0, 0.5, 0.0]),
         "group_id": np.zeros(4), "logp_old_sum": np.array([-2.0, -4.0, -6.0, -8.0]),
         "logp_new_sum": np.array([-3.0, -4.0, -5.0, -9.0]), "n_action_tokens": np.array([2, 4, 2, 4]),
         "n_actions": np.array([1, 2, 1, 2]), "n_actions_displaced": np.array([1, 0, 0, 1])}
    a = step_aggregates(s)
    assert a["reward_mean"] == 0.5 and a["accuracy"] == 0.5 and a["n_samples"] == 4
    assert a["ll_correct_sum"] == -4.0 and a["ll_correct_mean"] == -2.0
    assert a["ll_incorrect_sum"] == -6.0 and a["ll_incorrect_mean"] == -1.5
    # preserved = advantage >= 0: samples 0, 2, 3 with deltas -1, +1, -1
    assert a["delta_preserved"] == pytest.approx(-1 / 3)
    assert a["frac_responses_displaced"] == pytest.approx(2 / 3)
    assert a["frac_actions_displaced"] == pytest.approx(2 / 4)
    # an empty subset is NULL, never 0
    none_correct = step_aggregates({**s, "reward": np.zeros(4)})
    assert none_correct["ll_correct_sum"] is None and none_correct["accuracy"] == 0.0
    assert math.isnan(step_aggregates({**s, "reward": np.array([np.nan, 1, 1, 1])})["reward_mean"])
