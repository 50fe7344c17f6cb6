"""bench/detector_eval.py end to end on synthetic runs and on a small real store."""

from __future__ import annotations

import json

import pandas as pd

from bench import detector_eval
from lld_monitor.detect.synthetic import SpiralSpec, spiral


def test_eval_synthetic(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert detector_eval.main(["--synthetic", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recall" in text and "us/step" in text
    res = json.loads(out.read_text())
    for variant in ("full", "scalars"):
        s = res["summary"][variant]
        assert s["collapsing_runs"] == 2 and s["non_collapsing_runs"] == 2
        assert s["recall"] == 1.0 and s["runs_with_false_warnings"] == 0
    rows = [r for r in res["rows"] if r["collapse_step"] is not None]
    assert all(r["lead"] == r["collapse_step"] - r["first_warning"] for r in rows)


def test_phase2_onset_label_and_scalar_variant():
    df = spiral(SpiralSpec(seed=0))
    onset = detector_eval.phase2_onset(df, 190)
    assert 30 <= onset <= 100
    assert detector_eval.phase2_onset(df, None) is None
    df["actor/pos_avg_old_log_prob"] = df["ll_correct_mean"]
    df["critic/score/mean"] = df["reward_mean"]
    df["actor/mean_reduce_chunk"] = 1.0
    sc = detector_eval.scalar_only(df)
    assert set(sc.columns) == {"step", "actor/pos_avg_old_log_prob", "critic/score/mean"}
    # no verl names: derived from ours, the likelihood proxy from the samples table
    plain = spiral(SpiralSpec(seed=0))[["step", "reward_mean", "entropy"]]
    samples = pd.DataFrame({"step": [0, 0, 1], "advantage": [1.0, -1.0, 0.0],
                            "logp_old_sum": [-2.0, -4.0, -3.0], "n_action_tokens": [2, 2, 3]})
    sc = detector_eval.scalar_only(plain, samples)
    assert list(sc.columns) == ["step", "critic/score/mean", "actor/entropy_loss", "actor/pos_avg_old_log_prob"]
    assert sc["actor/pos_avg_old_log_prob"].iloc[0] == -0.5 and sc["actor/pos_avg_old_log_prob"].iloc[1] == -1.0
