"""Key mapping and mode inference (pure functions, no wandb)."""

from __future__ import annotations

import math

import pytest

from lld_monitor.integrations.wandb.run_profile import RunProfile, detect_family
from lld_monitor.signals import map_row, mapped_keys
from lld_monitor.store.schema import STEP_SIGNALS


@pytest.mark.parametrize(
    ("config", "mode"),
    [
        ({"actor_rollout_ref": {"actor": {"no_reduce_lambda": 0.2}}}, "llds"),
        ({"actor_rollout_ref": {"actor": {"no_reduce_lambda": "0.3", "mask_answer": "true"}}}, "llds_ma"),
        ({"actor_rollout_ref": {"actor": {"no_reduce_lambda": 0.0, "mask_answer": True}}}, "vanilla"),
        # W&B's stored config format {"key": {"value": v, "desc": ...}}
        ({"actor_rollout_ref": {"value": {"actor": {"no_reduce_lambda": 0.1}}, "desc": None}}, "llds"),
        ({"mode": "llds_ma", "lam": 0.2}, "llds_ma"),  # our own runs
        ({"llds": {"lam": 0.2, "gate": "action", "answer_weight": None}}, "llds"),
        ({"llds": {"lam": 0.2, "gate": "action", "answer_weight": 0.1}}, "llds_ma"),
        ({"llds_lambda": 0.0}, "vanilla"),
        ({"num_generations": 8, "beta": 0.04}, "vanilla"),  # TRL GRPO, no LLDS keys
        ({"algorithm": {"adv_estimator": "grpo"}}, "vanilla"),
        ({"lr": 1e-6}, "unknown"),
        ({}, "unknown"),
        (None, "unknown"),
    ],
)
def test_infer_mode(config, mode):
    got = RunProfile.read(config, ())
    assert got.mode == mode, got.mode_reason
    assert got.mode_reason


def test_infer_mode_from_keys_when_config_is_empty():
    assert RunProfile.read({}, {"actor/grad_norm", "critic/score/mean"}).mode == "vanilla"
    assert RunProfile.read({}, {"train/reward", "train/global_step"}).mode == "vanilla"
    assert RunProfile.read({}, {"my/custom"}).mode == "unknown"


def test_map_row_priority_and_types():
    row = {"actor/entropy_loss": 1.5, "actor/entropy": 9.0, "actor/grad_norm": float("nan"),
           "critic/score/mean": True, "train/reward": "0.3", "lld/kl": 0.01, "actor/kl_loss": 0.5}
    got = map_row(row)
    assert got["entropy"] == 1.5  # the Search-R1 name first
    assert math.isnan(got["grad_norm"])  # NaN is a value, kept
    assert "reward_mean" not in got  # a bool or a string is not a reward
    assert got["kl"] == 0.01  # our exporter's own key wins
    assert set(got) <= set(STEP_SIGNALS)


def test_answer_prob_only_with_a_span():
    assert "answer_prob_mean" not in map_row({"actor/lowest_prob_avg_mean": 0.0, "actor/is_answer_mask": 0.0})
    assert map_row({"actor/lowest_prob_avg_mean": 0.7, "actor/is_answer_mask": 0.5})["answer_prob_mean"] == 0.7


def test_unmapped_proxies_stay_unmapped():
    keys = {"actor/pos_avg_old_log_prob", "actor/neg_avg_old_log_prob", "actor/ppo_kl", "actor/mean_reduce_chunk",
            "train/loss"}
    assert mapped_keys(keys) == {}


def test_detect_family():
    assert detect_family({"actor/loss_noreduce"}) == "search-r1"
    assert detect_family({"actor/grad_norm"}) == "verl"
    assert detect_family({"train/global_step", "train/reward"}) == "trl"
    assert detect_family({"lld/step"}) == "lld-monitor"
    assert detect_family({"foo"}) == "unknown"


def test_field_names_mapped_and_family():
    """Names real runs log (issue 17): mapped where the meaning matches, kept under their own key otherwise."""
    from lld_monitor.integrations.wandb.run_profile import detect_family
    from lld_monitor.signals import map_row

    verl = {"perf/time_per_step": 12.5, "tool_call_counts/mean": 1.5, "num_turns/mean": 3.0,
            "actor/pg_clipfrac_lower": 0.01, "actor/entropy_loss": 0.7, "actor/pg_loss": 0.1}
    got = map_row(verl)
    assert got["step_time"] == 12.5
    assert "searches_per_response" not in got  # a proxy (every tool call): drawn under its own key, not stored
    assert "clip_frac" not in got  # dual-clip lower fraction is not the clip fraction
    # current verl's new engine logs actor/entropy_loss too: not a Search-R1 marker
    assert detect_family(verl) == "verl"
    assert detect_family({"env/number_of_actions/mean": 2.0, "env/finish_ratio": 1.0, "actor/pg_loss": 0.1}) == "search-r1"
    trl = {"train/tools/call_frequency": 0.5, "train/frac_reward_zero_std": 0.25, "train/rewards/em/mean": 0.4,
           "train/sampling/sampling_logp_difference/mean": 0.01, "train/global_step": 3}
    assert map_row(trl) == {}  # no exact counterpart: kept in metrics under their own names
    assert detect_family(trl) == "trl"
