"""One definition of the step aggregates: the same batch through every path that writes them gives
the same numbers — RunLogger (samples + tokens), the built-in trainer's payload, the TRL hook, and
verl's `lld_metrics` — including a preserved response with no tokens and one with only tool tokens."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lld_monitor import lld
from lld_monitor.aggregates import sample_sums_from_tokens, step_aggregates
from lld_monitor.logger import RunLogger
from lld_monitor.roles import ROLE_ACTION, ROLE_TOOL
from lld_monitor.store import open_store_reader

A, T = ROLE_ACTION, ROLE_TOOL
# 6 responses x 4 positions. r0: two actions around a tool token, both displaced (Δ -0.5 each);
# r1: one action, Δ 0; r2: no token at all (A = 0); r3: only tool tokens (A = 0); r4: A < 0, Δ -3;
# r5: correct with A < 0. Values are exact in float32.
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]]
ROLE = [[A, T, A, A], [A, A, A, A], [A, A, A, A], [T, T, T, T], [A, A, A, A], [A, A, A, A]]
OLD = [[-1, -5, -1, 0], [-2, -2, 0, 0], [0, 0, 0, 0], [-3, -3, -3, -3], [-1, -1, -1, 0], [-0.25, 0, 0, 0]]
NEW = [[-1.5, -9, -1.5, 0], [-1.5, -2.5, 0, 0], [0, 0, 0, 0], [-4, -4, -4, -4], [-2, -2, -2, 0], [-0.5, 0, 0, 0]]
REWARD = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
ADV = [1.0, 0.5, 0.0, 0.0, -1.0, -0.5]

# by hand: preserved = A >= 0 with >= 1 action token = r0, r1 (r2 has no token, r3 only tool tokens)
EXPECTED = {
    "reward_mean": 0.5,
    "accuracy": 0.5,
    "delta_preserved": (-1.0 + 0.0) / 2,
    "delta_preserved_mean": (-0.5 + 0.0) / 2,
    "frac_responses_displaced": 1 / 2,
    "frac_actions_displaced": 2 / 3,  # r0's two actions fell, r1's one did not
    "ll_correct_sum": (-2.0 - 4.0 - 0.25) / 3,
    "ll_correct_mean": (-1.0 - 2.0 - 0.25) / 3,
    "ll_incorrect_sum": -3.0,  # r4 only: r2 and r3 have no action token
    "ll_incorrect_mean": -1.0,
    "response_length": 8 / 6,
}
KEYS = sorted(EXPECTED)


def _t(rows, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def _batch():
    mask = _t(MASK, torch.bool)
    role = _t(ROLE, torch.long)
    act = mask & (role != ROLE_TOOL)
    return mask, role, act, _t(OLD), _t(NEW), _t(REWARD), _t(ADV)


def _logged(tmp_path, name: str, **log_step) -> dict[str, float]:
    store = tmp_path / "store"
    with RunLogger(store, name, "vanilla", {}, handle_signals=False, detector=False) as lg:
        lg.log_step(0, **log_step)
    row = open_store_reader(store).steps(lg.run_id).iloc[0]
    return {k: float(row[k]) for k in KEYS}


def via_run_logger(tmp_path) -> dict[str, float]:
    mask, role, act, old, new, reward, adv = _batch()
    samples = {"reward": reward, "advantage": adv, "group_id": np.zeros(6, dtype=np.int64)}
    tokens = {"token_id": torch.zeros(6, 4, dtype=torch.long), "mask": mask, "role": role,
              "action_idx": lld.action_index(act), "logp_old": old, "logp_new": new}
    return _logged(tmp_path, "logger", samples=samples, tokens=tokens)


def via_trainer(tmp_path) -> dict[str, float]:
    """The built-in trainer's per-step payload (Trainer._payload), logged as `train()` logs it."""
    import types

    from lld_monitor.backend.grpo import Scores, StepBatch, Trainer, UpdateStats

    mask, role, act, old, new, reward, adv = _batch()
    n = len(REWARD)
    ep = SimpleNamespace(n_actions=[1] * n, finished=[True] * n, n_valid_actions=[1] * n, response_mask=mask,
                         n_searches=[0] * n, response_texts=["x"] * n, response_ids=torch.zeros(n, 4, dtype=torch.long))
    rows = [(i, SimpleNamespace(qid=f"q{i}", question="q", answers=["a"])) for i in range(n)]
    batch = StepBatch(rows, ["g"] * n, ep, torch.zeros(n, 4, dtype=torch.long), mask.long(), 0, act,
                      torch.zeros_like(act))
    updates = UpdateStats(**{k: [0.0] for k in ("grad_norm", "clip_frac", "kl", "pg_loss", "ppo_kl", "llds_loss",
                                                  "entropy", "loss", "reduce_chunk")})
    fake = SimpleNamespace(cfg=SimpleNamespace(log=SimpleNamespace(token_every=0, token_groups=None)),
                           opt=SimpleNamespace(param_groups=[{"lr": 1e-3}]),
                           _verl_named_scalars=Trainer._verl_named_scalars)
    fake._scalars = types.MethodType(Trainer._scalars, fake)
    payload = Trainer._payload(fake, 0, batch, reward, adv, Scores(old, torch.zeros(n, 4), None), new, updates, 0.0,
                               dict(step=0.0, gen=0.0, ref=0.0, update_actor=0.0))
    agg = step_aggregates(payload.samples)  # what the rank-0 logger computes
    logged = _logged(tmp_path, "trainer", scalars=payload.scalars, samples=payload.samples)
    assert {k: agg[k] for k in KEYS} == logged
    return logged


def via_trl_hook(tmp_path) -> dict[str, float]:
    """LLDGRPOTrainer's own per-micro-batch record and end-of-step methods on the batch, then RunLogger."""
    pytest.importorskip("trl")
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer

    mask, role, act, old, new, reward, adv = _batch()
    n = len(REWARD)

    class Hook:  # the hook's state, without a model or a TRL training loop
        _lld_micro: list = []
        _lld_pending: dict = {}
        _lld_stash: dict = {}
        llds_cfg = None
        state = SimpleNamespace(global_step=0)
        accelerator = SimpleNamespace(num_processes=1)

        def _lld_flush_pending(self, before=None):
            pass

        def _decode(self, ids, m):
            return np.array(["x"] * len(ids), dtype=object)

    for name in ("_lld_record", "_lld_end_step", "_lld_gather", "_lld_gather_samples"):
        if hasattr(LLDGRPOTrainer, name):
            setattr(Hook, name, getattr(LLDGRPOTrainer, name))
    hook = Hook()
    inputs = {"completion_ids": torch.zeros(n, 4, dtype=torch.long), "lld_reward": reward,
              "lld_group": torch.zeros(n, dtype=torch.long)}
    args = dict(inputs=inputs, logps=new, old=old, adv=adv, mask=mask.long(), action=act,
                answer=None, llds_val=None, calls=torch.zeros(n, dtype=torch.long))
    params = inspect.signature(LLDGRPOTrainer._lld_record).parameters
    hook._lld_record(**{k: v for k, v in args.items() if k in params})
    hook._lld_end_step()
    scalars, samples, tokens = hook._lld_pending[1]
    return _logged(tmp_path, "trl", scalars=scalars, samples=samples, tokens=tokens)


def via_verl(tmp_path) -> dict[str, float]:
    from lld_monitor.integrations.trainers.verl_metrics import lld_metrics

    mask, role, act, old, new, reward, adv = _batch()
    got = lld_metrics({"old_log_probs": old, "log_prob": new, "advantages": adv, "response_mask": act,
                       "scores": reward})
    return {k: got[f"lld/{k}"] for k in KEYS}


PATHS = {"RunLogger": via_run_logger, "trainer": via_trainer, "TRL hook": via_trl_hook, "lld_metrics": via_verl}


def test_step_aggregates_by_hand():
    mask, role, act, old, new, reward, adv = _batch()
    sums = sample_sums_from_tokens({"mask": mask, "role": role, "action_idx": lld.action_index(act),
                                    "logp_old": old, "logp_new": new})
    got = step_aggregates({"reward": reward, "advantage": adv, **sums})
    assert {k: got[k] for k in KEYS} == pytest.approx(EXPECTED, abs=1e-12)
    assert sums["n_action_tokens"].tolist() == [2, 2, 0, 0, 3, 1]
    assert sums["n_actions_displaced"].tolist() == [2, 0, 0, 0, 1, 1]
    assert math.isnan(sums["delta_mean"][2]) and math.isnan(sums["delta_mean"][3])  # no action token: no per-token Δ


def test_same_batch_same_numbers_on_every_path(tmp_path):
    results = {name: fn(tmp_path / name.replace(" ", "_")) for name, fn in PATHS.items()}
    for name, got in results.items():
        assert got == pytest.approx(EXPECTED, abs=1e-12), name
    ref = results["RunLogger"]
    for name, got in results.items():
        assert got == ref, f"{name} differs from RunLogger: {got} vs {ref}"  # identical, not just close


def test_no_preserved_response_with_tokens_is_null_not_zero():
    mask, role, act, old, new, reward, adv = _batch()
    sums = sample_sums_from_tokens({"mask": mask, "role": role, "action_idx": lld.action_index(act),
                                    "logp_old": old, "logp_new": new})
    keep = [2, 3, 4]  # no-token, all-tool (both A >= 0) and one A < 0 response
    got = step_aggregates({"reward": reward.numpy()[keep], "advantage": adv.numpy()[keep],
                           **{k: v[keep] for k, v in sums.items()}})
    assert got["delta_preserved"] is None and got["frac_responses_displaced"] is None
    assert got["frac_actions_displaced"] is None and got["delta_preserved_mean"] is None
    assert got["ll_correct_sum"] is None  # no correct response
