"""payload.py, by hand: what every trainer's step becomes (roles, tool-result blocks, per-response advantages,
per-sample sums, NaN off the model's tokens), and the same numbers whichever trainer path builds them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lld_monitor import lld
from lld_monitor.payload import step_payload, step_samples, step_tokens, token_roles, tool_runs
from lld_monitor.roles import ROLE_ACTION, ROLE_ANSWER, ROLE_TOOL, ROLES

A, T, S = ROLE_ACTION, ROLE_TOOL, ROLE_ANSWER
# two responses, 8 positions: model tokens, a tool block, more model tokens, an answer span, padding
VALID = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
MODEL = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0, 0]], dtype=torch.bool)
ANSWER = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
OLD = torch.tensor([[-1.0, -2.0, -9.0, -9.0, -0.5, -0.25, -0.25, 0.0], [-1.0, -9.0, -3.0, -9.0, -2.0, 0.0, 0.0, 0.0]])
NEW = OLD + torch.tensor([[0.5, -1.0, 7.0, 7.0, 0.0, -0.25, 0.25, 0.0], [-1.0, 5.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0]])


def test_the_role_codes_are_the_stores_names_in_order():
    assert ROLES[A] == "action" and ROLES[T] == "tool" and ROLES[S] == "answer"
    from lld_monitor import logger

    assert logger._ROLES_ARROW.to_pylist() == list(ROLES)  # the names the store gets, by code


def test_roles_and_tool_blocks_by_hand():
    assert token_roles(VALID, MODEL, ANSWER).tolist() == [[A, A, T, T, A, S, S, T], [A, T, A, T, A, T, T, T]]
    assert token_roles(VALID, MODEL).tolist()[0] == [A, A, T, T, A, A, A, T]
    assert tool_runs(VALID, MODEL).tolist() == [1, 2]  # one search result; two one-token blocks
    assert tool_runs(VALID, VALID).tolist() == [0, 0]
    assert tool_runs(torch.zeros(3, 0, dtype=torch.bool), torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]


def test_samples_by_hand():
    s = step_samples(model_mask=MODEL, valid_mask=VALID, logp_old=OLD, logp_new=NEW, advantages=torch.tensor([0.5, -1.0]),
                     rewards=torch.tensor([1.0, 0.0]), group_ids=["g", "g"], texts=["a", None], question=["q", "q"])
    assert s["n_action_tokens"].tolist() == [5, 3]
    assert s["logp_old_sum"].tolist() == [-1.0 - 2.0 - 0.5 - 0.25 - 0.25, -1.0 - 3.0 - 2.0]
    assert s["delta_sum"].tolist() == [0.5 - 1.0 + 0.0 - 0.25 + 0.25, -1.0 + 1.0 + 0.0]
    assert s["n_actions"].tolist() == [2, 3]  # maximal runs of model tokens
    # per action: response 0: (0.5 - 1.0) < 0, (0 - 0.25 + 0.25) = 0; response 1: -1 < 0, +1, 0
    assert s["n_actions_displaced"].tolist() == [1, 1]
    assert s["n_searches"].tolist() == [1, 2] and s["sample_idx"].tolist() == [0, 1]
    assert s["group_id"].tolist() == s["prompt_id"].tolist() == ["g", "g"] and s["text"].tolist() == ["a", None]
    assert s["reward"].dtype == np.float64 and s["advantage"].tolist() == [0.5, -1.0]
    assert s["question"].tolist() == ["q", "q"]


def test_tiled_advantages_are_read_at_the_first_model_token():
    tiled = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    tiled[0, :7] = 0.5
    tiled[1, :5] = -1.0
    s = step_samples(model_mask=MODEL, logp_old=OLD, logp_new=NEW, advantages=tiled)
    assert s["advantage"].tolist() == [0.5, -1.0]
    with pytest.raises(ValueError, match="NaN"):
        step_samples(model_mask=MODEL, logp_old=OLD, logp_new=NEW, advantages=torch.tensor([math.nan, 0.0]))


def test_tokens_are_nan_off_the_models_tokens():
    t = step_tokens(token_ids=torch.arange(16).view(2, 8), valid_mask=VALID, model_mask=MODEL, answer_mask=ANSWER,
                    logp_old=OLD, logp_new=NEW, entropy=torch.ones(2, 8))
    assert t["mask"].tolist() == VALID.tolist() and t["role"][0, 5] == S
    assert t["action_idx"].tolist()[1] == [0, -1, 1, -1, 2, -1, -1, -1]
    assert np.isnan(t["logp_old"][0, 2]) and t["logp_old"][0, 1] == -2.0 and np.isnan(t["entropy"][1, 1])
    assert "logp_ref" not in t


def test_the_payload_goes_through_the_logger_as_given(tmp_path):
    """What RunLogger stores from a payload: the samples' sums as computed here, tool tokens with NULL
    log-probs, the answer span's role."""
    from lld_monitor.logger import RunLogger
    from lld_monitor.store import open_store_reader

    p = step_payload(token_ids=torch.arange(16).view(2, 8), valid_mask=VALID, model_mask=MODEL, answer_mask=ANSWER,
                     logp_old=OLD, logp_new=NEW, advantages=torch.tensor([0.5, -1.0]),
                     rewards=torch.tensor([1.0, 0.0]), group_ids=["g", "g"], scalars={"grad_norm": 0.5})
    with RunLogger(tmp_path, "p", "vanilla", handle_signals=False, detector=False) as lg:
        lg.log_step(0, **p.as_kwargs())
    with open_store_reader(tmp_path) as r:
        run = r.runs().run_id.iloc[0]
        samples, tokens, steps = r.samples(run), r.tokens(run, 0), r.steps(run)
    assert samples.delta_sum.tolist() == p.samples["delta_sum"].tolist()
    assert len(tokens) == int(VALID.sum())
    tool = tokens[tokens.role == "tool"]
    assert len(tool) == 4 and tool.logp_old.isna().all()
    assert tokens[tokens.role == "answer"].position.tolist() == [5, 6]
    assert steps.grad_norm.iloc[0] == 0.5 and steps.n_samples.iloc[0] == 2


def test_lld_action_index_is_the_payloads_run_index():
    assert lld.action_index(MODEL).tolist() == step_tokens(
        token_ids=torch.zeros(2, 8, dtype=torch.long), valid_mask=VALID, model_mask=MODEL, logp_old=OLD,
        logp_new=NEW)["action_idx"].tolist()


def test_the_authors_metrics_by_hand():
    from lld_monitor.payload import authors_scalars

    adv = torch.tensor([0.5, -1.0])
    got = authors_scalars(model_mask=MODEL, logp_old=OLD, advantages=adv, logp_ref=OLD * 2, answer_mask=ANSWER,
                          logp_now=NEW)
    n = int(MODEL.sum())  # 8 model tokens
    assert got["actor/pos_avg_old_log_prob"] == pytest.approx((-1.0 - 2.0 - 0.5 - 0.25 - 0.25) / n)
    assert got["actor/neg_avg_old_log_prob"] == pytest.approx((-1.0 - 3.0 - 2.0) / n)
    assert got["actor/pos_avg_ref_log_prob"] == pytest.approx(2 * got["actor/pos_avg_old_log_prob"])
    span = [math.exp(-0.5), math.exp(0.0)]  # the answer tokens' ln π under NEW: -0.25 - 0.25, -0.25 + 0.25
    assert got["actor/lowest_prob_avg_mean"] == pytest.approx(sum(span) / 2)
    assert got["actor/lowest_prob_avg_min"] == pytest.approx(min(span))  # one response has a span
    none = authors_scalars(model_mask=MODEL, logp_old=OLD, advantages=adv, answer_mask=torch.zeros_like(ANSWER),
                           logp_now=NEW)
    assert math.isnan(none["actor/lowest_prob_avg_mean"]) and "actor/pos_avg_ref_log_prob" not in none
