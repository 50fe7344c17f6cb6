"""verl helper on tensors of verl's shapes ([B, R] response-side, Â tiled, loss_mask with observation gaps),
checked against loop re-implementations of the official Search-R1 code (dp_actor.py, research/paper.md §4.1)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from lld_monitor.integrations.trainers.verl_metrics import lld_metrics  # noqa: E402
from lld_monitor.lld import LLDSConfig  # noqa: E402

N_PROMPTS, N_AGENT, R = 4, 5, 96  # 20 trajectories, max_response_length 96


def verl_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B = N_PROMPTS * N_AGENT
    attn = torch.zeros(B, R, dtype=torch.long)
    loss_mask = torch.zeros(B, R, dtype=torch.long)
    answer_mask = torch.ones(B, R, dtype=torch.long)  # Search-R1: 0 on the answer span
    valid_search = torch.zeros(B)
    for i in range(B):
        length = int(torch.randint(30, R, (1,), generator=g))
        attn[i, :length] = 1
        loss_mask[i, :length] = 1
        # 1-2 observation blocks (<information> ... </information>) excluded from the loss
        n_obs = int(torch.randint(0, 3, (1,), generator=g))
        valid_search[i] = n_obs
        for k in range(n_obs):
            s = 8 + k * 12
            loss_mask[i, s : s + 6] = 0
        if i % 3:
            answer_mask[i, length - 5 : length] = 0  # the final <answer> ... </answer> span
    scores = (torch.rand(B, generator=g) > 0.6).float()
    grouped = scores.view(N_PROMPTS, N_AGENT)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
    old = -torch.rand(B, R, generator=g) * 3
    new = old + torch.randn(B, R, generator=g) * 0.05
    ref = old + torch.randn(B, R, generator=g) * 0.1
    tls = torch.zeros(B, R)
    last = attn.sum(1) - 1
    tls[torch.arange(B), last] = scores  # reward at the last valid token
    return {
        "old_log_probs": old,
        "log_prob": new,
        "ref_log_prob": ref,
        "advantages": adv.unsqueeze(1) * attn,  # tiled over the response attention mask
        "loss_mask": loss_mask,
        "answer_mask": answer_mask,
        "token_level_scores": tls,
        "valid_search_stats": valid_search,
        "entropys": torch.rand(B, R, generator=g) * 2,
    }, adv, scores


def chunks(mask_row):
    out, cur = [], []
    for t, m in enumerate(mask_row):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def test_signals_match_loop_reference():
    batch, adv, scores = verl_batch()
    got = lld_metrics(batch)
    B = adv.shape[0]
    old, new, m = batch["old_log_probs"].tolist(), batch["log_prob"].tolist(), batch["loss_mask"].tolist()
    pres = [i for i in range(B) if adv[i] >= 0]
    sums = [sum(new[i][t] - old[i][t] for t in range(R) if m[i][t]) for i in range(B)]
    ntok = [sum(m[i]) for i in range(B)]
    assert got["lld/delta_preserved"] == pytest.approx(sum(sums[i] for i in pres) / len(pres), rel=1e-5)
    assert got["lld/delta_preserved_mean"] == pytest.approx(
        sum(sums[i] / ntok[i] for i in pres) / len(pres), rel=1e-5)
    assert got["lld/frac_responses_displaced"] == pytest.approx(sum(sums[i] < 0 for i in pres) / len(pres))
    acts = [sum(new[i][t] - old[i][t] for t in c) for i in pres for c in chunks(m[i])]
    assert got["lld/frac_actions_displaced"] == pytest.approx(sum(a < 0 for a in acts) / len(acts))
    assert got["lld/response_length"] == pytest.approx(sum(ntok) / B)
    assert got["lld/reward_mean"] == pytest.approx(float(scores.mean()))
    assert got["lld/accuracy"] == pytest.approx(float((scores > 0).float().mean()))
    corr = [i for i in range(B) if scores[i] > 0]
    ll = [sum(old[i][t] for t in range(R) if m[i][t]) for i in range(B)]
    assert got["lld/ll_correct_sum"] == pytest.approx(sum(ll[i] for i in corr) / len(corr), rel=1e-5)
    assert got["lld/ll_incorrect_mean"] == pytest.approx(
        sum(ll[i] / ntok[i] for i in range(B) if i not in corr) / (B - len(corr)), rel=1e-5)
    ref = batch["ref_log_prob"].tolist()
    k3 = [math.exp(ref[i][t] - new[i][t]) - (ref[i][t] - new[i][t]) - 1 for i in range(B) for t in range(R) if m[i][t]]
    assert got["lld/kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-4)
    am = batch["answer_mask"].tolist()
    span = [math.exp(new[i][t]) for i in range(B) for t in range(R) if m[i][t] and am[i][t] == 0]
    assert got["lld/answer_prob_mean"] == pytest.approx(sum(span) / len(span), rel=1e-5)
    assert got["lld/searches_per_response"] == pytest.approx(float(batch["valid_search_stats"].mean()))
    ent = batch["entropys"].tolist()
    e = [ent[i][t] for i in range(B) for t in range(R) if m[i][t]]
    assert got["lld/entropy"] == pytest.approx(sum(e) / len(e), rel=1e-5)
    assert got["lld/n_samples"] == B
    # the LLDS authors' own metrics under their names: Σ ln π_old over Â ≥ 0 (Â < 0) model tokens / all model tokens
    n_all = sum(ntok)
    pos_sum = sum(old[i][t] for i in range(B) for t in range(R) if m[i][t] and adv[i] >= 0)
    neg_sum = sum(old[i][t] for i in range(B) for t in range(R) if m[i][t] and adv[i] < 0)
    assert got["actor/pos_avg_old_log_prob"] == pytest.approx(pos_sum / n_all, rel=1e-5)
    assert got["actor/neg_avg_old_log_prob"] == pytest.approx(neg_sum / n_all, rel=1e-5)
    assert "actor/pos_avg_ref_log_prob" in got
    assert all(k.startswith("lld/") or k.startswith("actor/") and k.endswith("_log_prob") for k in got)


def official_loss_noreduce(batch, lam, chunked=True):
    """dp_actor.py lines 347-396 (A-gate `chunk_noreduce=true`, or R-gate), token mean over response_mask."""
    old, new, m = batch["old_log_probs"].tolist(), batch["log_prob"].tolist(), batch["loss_mask"].tolist()
    adv = batch["advantages"].tolist()
    B = len(old)
    total, count = 0.0, 0
    for i in range(B):
        count += sum(m[i])
        first = next(t for t in range(R) if m[i][t])
        if adv[i][first] < 0:
            continue
        d = [old[i][t] - new[i][t] for t in range(R)]
        if chunked:
            for c in chunks(m[i]):
                if sum(d[t] for t in c) > 0:
                    total += sum(max(0.0, d[t]) * lam for t in c)
        else:
            if sum(d[t] for t in range(R) if m[i][t]) > 0:
                total += sum(max(0.0, d[t]) * lam for t in range(R) if m[i][t])
    return total / count


@pytest.mark.parametrize("gate", ["action", "response"])
def test_llds_matches_official_loss_noreduce(gate):
    batch, _, _ = verl_batch(seed=3)
    got = lld_metrics(batch, llds=LLDSConfig(lam=0.2, gate=gate, norm="token_mean"))
    want = official_loss_noreduce(batch, 0.2, chunked=gate == "action")
    assert want > 0
    assert got["lld/llds_loss"] == pytest.approx(want, rel=1e-5)


def test_dataproto_like_and_defaults():
    batch, _, _ = verl_batch(seed=5)
    minimal = {k: batch[k] for k in ("old_log_probs", "log_prob", "advantages")}
    minimal["response_mask"] = batch["loss_mask"]
    got = lld_metrics(SimpleNamespace(batch=minimal))
    assert "lld/reward_mean" not in got and "lld/kl" not in got and "lld/llds_loss" not in got
    assert math.isfinite(got["lld/delta_preserved"])
    # an answer mask that is 1 on the span
    span_mask = (batch["answer_mask"] == 0).long()
    a = lld_metrics({**batch, "answer_mask": span_mask}, answer_mask_zero_on_span=False)
    b = lld_metrics(batch)
    assert a["lld/answer_prob_mean"] == pytest.approx(b["lld/answer_prob_mean"])
    # no preserved response -> NaN, never a fake 0
    neg = {**minimal, "advantages": -torch.ones_like(batch["old_log_probs"])}
    assert math.isnan(lld_metrics(neg)["lld/delta_preserved"])


def test_bad_input_messages():
    batch, _, _ = verl_batch()
    with pytest.raises(KeyError, match="old_log_probs"):
        lld_metrics({"log_prob": batch["log_prob"]})
    with pytest.raises(ValueError, match=r"\[B, R\]"):
        lld_metrics({**batch, "log_prob": batch["log_prob"][:, :10]})
    with pytest.raises(ValueError, match="answer_mask"):
        lld_metrics({k: v for k, v in batch.items() if k != "answer_mask"}, llds=LLDSConfig(answer_weight=0.1))
