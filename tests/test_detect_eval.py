"""bench/detector_eval.py: labels, seed split, variants, scoring, end to end on synthetic runs."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from bench import detector_eval as ev
from lld_monitor.detect import DetectorConfig
from lld_monitor.detect.synthetic import SpiralSpec, healthy, spiral


def _reward_run(reward: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"step": np.arange(reward.size), "reward_mean": reward})


def test_labels_follow_the_written_rule():
    cfg = DetectorConfig()
    flat = np.full(120, 0.6)
    assert ev.label_run(_reward_run(flat), cfg).label == "healthy"
    collapsed = np.r_[np.full(80, 0.6), np.full(40, 0.05)]
    lab = ev.label_run(_reward_run(collapsed), cfg)
    assert lab.label == "collapse" and lab.collapse_step is not None and 80 <= lab.collapse_step <= 90
    # last 20 at 0.42 (< 0.8 x 0.6) but the trailing mean never falls under 0.5 x peak: degraded
    degraded = np.r_[np.full(80, 0.6), np.full(40, 0.42)]
    lab = ev.label_run(_reward_run(degraded), cfg)
    assert lab.label == "degraded" and lab.collapse_step is None and lab.decline_step is not None
    assert abs(lab.last_mean - 0.42) < 1e-9 and abs(lab.peak - 0.6) < 1e-9


def test_seed_split_is_odd_tune_even_report():
    assert ev.seed_of("vanilla-seed3") == 3 and ev.half_of("vanilla-seed3") == "tune"
    assert ev.half_of("llds-seed4") == "report" and ev.half_of("probe-lr2e-3-seed10") == "report"
    assert ev.half_of("sample-llds-ma-seed_7") == "tune"
    assert ev.seed_of("spiral-vanilla") is None and ev.half_of("spiral-vanilla") == "unsplit"


def test_scalar_variants_keep_only_what_the_platform_logs():
    df = spiral(SpiralSpec(seed=0))
    df["actor/pos_avg_old_log_prob"] = df["ll_correct_mean"]
    df["critic/score/mean"] = df["reward_mean"]
    df["actor/mean_reduce_chunk"] = 1.0
    df["lld/grad_norm_max"] = 1.0
    assert set(ev.scalars_verl(df).columns) == {"step", "actor/pos_avg_old_log_prob", "critic/score/mean"}
    trl = ev.scalars_trl(df)
    assert set(trl.columns) == {"step", "train/reward", "train/entropy", "train/grad_norm",
                                "train/clip_ratio/region_mean", "train/kl"}
    assert (trl["train/reward"] == df["reward_mean"]).all()
    # no verl names: derived from ours, the likelihood proxy from the samples table
    plain = spiral(SpiralSpec(seed=0))[["step", "reward_mean", "entropy"]]
    samples = pd.DataFrame({"step": [0, 0, 1], "advantage": [1.0, -1.0, 0.0],
                            "logp_old_sum": [-2.0, -4.0, -3.0], "n_action_tokens": [2, 2, 3]})
    sc = ev.scalars_verl(plain, samples)
    assert list(sc.columns) == ["step", "critic/score/mean", "actor/entropy_loss", "actor/pos_avg_old_log_prob"]
    assert sc["actor/pos_avg_old_log_prob"].iloc[0] == -0.5 and sc["actor/pos_avg_old_log_prob"].iloc[1] == -1.0


def test_scoring_and_summary():
    cfg = DetectorConfig()
    sig = spiral(SpiralSpec(seed=2))
    lab = ev.label_run(sig, cfg)
    row = ev.score("synthetic-spiral-seed2", "synthetic", "vanilla", "full", sig, lab, cfg)
    assert row.label == "collapse" and row.half == "report" and row.warned
    assert row.lead == row.collapse_step - row.first_warning
    h = healthy(seed=2)
    hrow = ev.score("synthetic-healthy-seed2", "synthetic", "llds", "full", h, ev.label_run(h, cfg), cfg)
    assert hrow.label == "healthy" and not hrow.warned
    s = ev.summarize([row, hrow])["report"]["full"]
    assert s["recall"] == 1.0 and s["precision"] == 1.0 and s["healthy_warned"] == 0
    assert s["lead_min"] == row.lead and s["goal_met"] == (row.lead >= 40)


def test_eval_synthetic_end_to_end(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert ev.main(["--synthetic", "2", "--markdown", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| run | half | label |" in text and "us/step" in text
    res = json.loads(out.read_text())
    assert set(res["summary"]) == {"tune", "report"}
    for half in ("tune", "report"):
        assert set(res["summary"][half]) == set(ev.VARIANTS)
        s = res["summary"][half]["full"]
        assert s["collapse_runs"] == 1 and s["healthy_runs"] == 1 and s["recall"] == 1.0
        assert s["healthy_warned"] == 0
    assert len(res["rows"]) == 4 * len(ev.VARIANTS)


def test_half_tune_hides_the_reported_half(tmp_path, capsys):
    """Tuning is done blind: --half tune shows neither the reported half's runs nor its summary."""
    out = tmp_path / "tune.json"
    assert ev.main(["--synthetic", "2", "--half", "tune", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "report" not in text and "tune" in text
    res = json.loads(out.read_text())
    assert set(res["summary"]) == {"tune"} and {r["half"] for r in res["rows"]} == {"tune"}


def test_a_run_stopped_before_its_end_is_not_counted_unless_it_had_collapsed():
    """A crashed or killed run has no known outcome: 20 calm steps must not count as a healthy run."""
    cfg = DetectorConfig()
    calm = _reward_run(np.full(20, 0.9))
    collapsed = _reward_run(np.r_[np.full(80, 0.6), np.full(40, 0.05)])

    def src():
        yield "calm-seed2", "s", "llds", calm, None, "crashed"
        yield "fell-seed2", "s", "vanilla", collapsed, None, "crashed"
        yield "live-seed2", "s", "llds", calm, None, "running"
        yield "done-seed2", "s", "llds", calm, None, "finished"

    rows, _ = ev.evaluate_sources([src()], cfg)
    labels = {r.run: r.label for r in rows if r.variant == "full"}
    assert labels == {"calm-seed2": "stopped", "fell-seed2": "collapse", "live-seed2": "running", "done-seed2": "healthy"}
    s = ev.summarize(rows)["report"]["full"]
    assert s["healthy_runs"] == 1 and s["collapse_runs"] == 1
