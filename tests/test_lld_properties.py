"""Property tests over random shapes and masks (hypothesis), against a plain-Python reference.

Values are drawn as multiples of 0.25 so that sums are exact, ties (d = 0, action sum = 0) occur,
and the vectorized code and the loop reference must agree on every gate decision.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lld_monitor.lld import (
    LLDSConfig,
    action_index,
    answer_span_mask,
    displacement,
    displacement_summary,
    grpo_advantages,
    llds_loss,
    ppo_clip_loss,
)

SETTINGS = settings(max_examples=60, deadline=None)
GATES = ("action", "response", "token")
NORMS = ("response", "token_mean")


@st.composite
def batches(draw):
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 14))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=gen) < draw(st.sampled_from([0.3, 0.7, 0.95, 1.0]))
    old = (torch.randint(-12, 0, (b, t), generator=gen) * 0.25).float()
    new = old - (torch.randint(-4, 5, (b, t), generator=gen) * 0.25).float()
    old = torch.where(mask, old, torch.full_like(old, float("nan")))  # tool tokens: no log-prob
    new = torch.where(mask, new, torch.full_like(new, float("nan")))
    adv = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])[torch.randint(0, 5, (b,), generator=gen)]
    answer = (torch.rand(b, t, generator=gen) < 0.3) & mask
    beta = draw(st.sampled_from([None, 0.0, 0.5, 1.0]))
    return new, old, mask, adv, answer, beta


def _runs(mask_row):
    runs, cur = [], []
    for j, m in enumerate(mask_row):
        if m:
            cur.append(j)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def reference_llds(new, old, mask, adv, answer, beta, gate, norm):
    """Straight loops over the paper's formula (see lld.py's docstring)."""
    per_resp, pre_count, total_pen, total_tok = 0.0, 0, 0.0, 0
    for i in range(new.shape[0]):
        m = mask[i].tolist()
        n_i = sum(m)
        total_tok += n_i
        if adv[i] < 0 or n_i == 0:
            continue
        pre_count += 1
        d = [(old[i, j] - new[i, j]).item() if m[j] else 0.0 for j in range(len(m))]
        resp_open = sum(d) > 0
        pen = 0.0
        for run in _runs(m):
            if gate == "action":
                open_ = sum(d[j] for j in run) > 0
            elif gate == "response":
                open_ = resp_open
            else:
                open_ = True
            if not open_:
                continue
            for j in run:
                w = beta if (beta is not None and answer[i, j]) else 1.0
                pen += w * max(0.0, d[j])
        per_resp += pen / n_i
        total_pen += pen
    if norm == "response":
        return per_resp / pre_count if pre_count else 0.0
    return total_pen / total_tok if total_tok else 0.0


def _cfg(gate, norm, beta):
    return LLDSConfig(gate=gate, norm=norm, answer_weight=beta)


@SETTINGS
@given(batches())
def test_llds_matches_reference_and_is_nonnegative(batch):
    new, old, mask, adv, answer, beta = batch
    for gate in GATES:
        for norm in NORMS:
            loss, st_ = llds_loss(new, old, adv, mask, _cfg(gate, norm, beta), answer_mask=answer)
            assert torch.isfinite(loss)
            assert loss.item() >= 0.0
            ref = reference_llds(new, old, mask, adv, answer, beta, gate, norm)
            assert math.isclose(loss.item(), ref, abs_tol=1e-6), (gate, norm, loss.item(), ref)


@SETTINGS
@given(batches())
def test_gated_loss_at_most_token_level(batch):
    new, old, mask, adv, answer, beta = batch
    for norm in NORMS:
        tok, _ = llds_loss(new, old, adv, mask, _cfg("token", norm, beta), answer_mask=answer)
        for gate in ("action", "response"):
            gated, _ = llds_loss(new, old, adv, mask, _cfg(gate, norm, beta), answer_mask=answer)
            assert gated.item() <= tok.item() + 1e-7


@SETTINGS
@given(batches(), st.integers(1, 6), st.sampled_from(["nan", "random", "zero"]))
def test_right_padding_invariance(batch, pad, fill):
    new, old, mask, adv, answer, beta = batch
    b = new.shape[0]
    filler = {"nan": torch.full((b, pad), float("nan")), "random": torch.randn(b, pad), "zero": torch.zeros(b, pad)}[fill]
    new_p = torch.cat([new, filler], 1)
    old_p = torch.cat([old, filler.flip(0) - 1.0], 1)
    mask_p = torch.cat([mask, torch.zeros(b, pad, dtype=torch.bool)], 1)
    ans_p = torch.cat([answer, torch.ones(b, pad, dtype=torch.bool)], 1)  # even a True answer mask on padding
    for gate in GATES:
        for norm in NORMS:
            a, sa = llds_loss(new, old, adv, mask, _cfg(gate, norm, beta), answer_mask=answer)
            p, sp = llds_loss(new_p, old_p, adv, mask_p, _cfg(gate, norm, beta), answer_mask=ans_p)
            assert a.item() == p.item() and sa == sp
    ds, dp = displacement(new, old, mask), displacement(new_p, old_p, mask_p)
    assert torch.equal(ds.response_sum, dp.response_sum) and torch.equal(ds.action_sum, dp.action_sum)
    sa, sp = displacement_summary(ds, adv), displacement_summary(dp, adv)
    assert all((sa[k] == sp[k]) or (math.isnan(sa[k]) and math.isnan(sp[k])) for k in sa)
    pa, _ = ppo_clip_loss(new, old, adv, mask)
    pp, _ = ppo_clip_loss(new_p, old_p, adv, mask_p)
    assert math.isclose(pa.item(), pp.item(), rel_tol=1e-6, abs_tol=1e-7)  # exp() values: summation order


@SETTINGS
@given(batches())
def test_gradient_zero_off_penalized_and_negative_on_penalized(batch):
    new, old, mask, adv, answer, beta = batch
    for gate in GATES:
        for norm in NORMS:
            x = new.clone().requires_grad_(True)
            loss, st_ = llds_loss(x, old, adv, mask, _cfg(gate, norm, beta), answer_mask=answer)
            loss.backward()
            g = x.grad
            assert torch.isfinite(g).all()
            assert int((g < 0).sum()) == st_["n_penalized_tokens"]
            assert int((g != 0).sum()) == st_["n_penalized_tokens"]  # exactly zero elsewhere
            d = torch.where(mask, old - new, torch.zeros_like(old))
            assert (d[g < 0] > 0).all()  # only tokens whose likelihood fell are pushed up
            assert (g[adv < 0] == 0).all() and (g[~mask] == 0).all()


@SETTINGS
@given(batches())
def test_displacement_consistency(batch):
    new, old, mask, adv, _, _ = batch
    s = displacement(new, old, mask)
    assert torch.allclose(s.action_sum.sum(1), s.response_sum, atol=1e-6)
    assert torch.equal(s.action_len.sum(1), s.n_tokens)
    assert s.n_actions.tolist() == [len(_runs(r.tolist())) for r in mask]
    idx = action_index(mask)
    for i, row in enumerate(mask.tolist()):
        for k, run in enumerate(_runs(row)):
            assert all(idx[i, j].item() == k for j in run)
    summ = displacement_summary(s, adv)
    pre = [(a >= 0) and n > 0 for a, n in zip(adv.tolist(), s.n_tokens.tolist())]
    assert summ["n_preserved"] == sum(pre)
    if sum(pre):
        fell = sum(1 for i, p in enumerate(pre) if p and s.response_sum[i] < 0)
        assert summ["frac_responses_displaced"] == fell / sum(pre)


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, 0.5, 2.0, -1.0])), min_size=1, max_size=25),
    st.booleans(),
)
def test_grpo_matches_torch_std_per_group(items, unbiased):
    gids = [g for g, _ in items]
    r = torch.tensor([v for _, v in items])
    adv = grpo_advantages(r, gids, unbiased=unbiased)
    for g in set(gids):
        idx = [i for i, x in enumerate(gids) if x == g]
        rg = r[idx].double()
        if len(idx) == 1 or bool((rg == rg[0]).all()):
            exp = torch.zeros(len(idx), dtype=torch.float64)
        else:
            exp = (rg - rg.mean()) / (rg.std(unbiased=unbiased) + 1e-6)
        assert torch.allclose(adv[idx].double(), exp, atol=1e-5), (g, adv[idx], exp)


def _ref_span(ids, mask, open_ids, close_ids):
    t = len(ids)
    lo, lc = len(open_ids), len(close_ids)

    def match(j, pat):
        return j + len(pat) <= t and ids[j : j + len(pat)] == pat and all(mask[j : j + len(pat)])

    closes = [j for j in range(t) if match(j, close_ids)]
    if not closes:
        return [False] * t
    c = closes[-1]
    opens = [j for j in range(t) if match(j, open_ids) and j + lo <= c]
    if not opens:
        return [False] * t
    o = opens[-1]
    return [(o <= j < c + lc) and bool(mask[j]) for j in range(t)]


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 16), st.integers(0, 2**31 - 1), st.sampled_from([((1,), (2,)), ((1, 3), (2, 3)), ((1,), (2, 2))]))
def test_answer_span_matches_reference(b, t, seed, tags):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (b, t), generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.85
    open_ids, close_ids = tags
    got = answer_span_mask(ids, mask, open_ids, close_ids)
    for i in range(b):
        assert got[i].tolist() == _ref_span(ids[i].tolist(), mask[i].tolist(), list(open_ids), list(close_ids))


def official_code_reference(new, old, mask, adv, answer, lam, chunk, mask_answer, answer_lambda, adaptive, v_mean):
    """Loop re-implementation of the official dp_actor.py LLDS term as described in paper.md §4.1
    (λ folded in): d = old − new; chunks of response_mask·[A≥0]; coeff = λ off the answer span,
    min(mask_weight, λ) on it (mask_weight = answer_lambda, or answer_lambda·max(V−1, 0) when
    adaptive); loss = Σ penalty / Σ response_mask."""
    mask_weight = answer_lambda * max(v_mean - 1.0, 0.0) if adaptive else answer_lambda
    total, denom = 0.0, int(mask.sum())
    for i in range(new.shape[0]):
        pos = adv[i] >= 0
        m = [bool(x) and bool(pos) for x in mask[i].tolist()]
        d = [(old[i, j] - new[i, j]).item() if m[j] else 0.0 for j in range(len(m))]
        if chunk:
            flags = [False] * len(m)
            for run in _runs(m):
                if sum(d[j] for j in run) > 0:
                    for j in run:
                        flags[j] = True
        else:
            s_i = sum(d[j] for j in range(len(m)) if m[j])
            flags = [s_i > 0] * len(m)
        for j in range(len(m)):
            if not (m[j] and flags[j]):
                continue
            coeff = min(mask_weight, lam) if (mask_answer and answer[i, j]) else lam
            total += coeff * max(0.0, d[j])
    return total / denom if denom else 0.0


@SETTINGS
@given(
    batches(),
    st.sampled_from([0.2, 0.3]),
    st.booleans(),
    st.sampled_from([(False, 0.2, False), (True, 0.05, False), (True, 0.2, False), (True, 0.1, True), (True, 0.3, True)]),
    st.sampled_from([0.0, 1.0, 1.5, 2.0, 3.5]),
)
def test_token_mean_option_reproduces_official_code(batch, lam, chunk, ma, v_mean):
    new, old, mask, adv, answer, _ = batch
    mask_answer, answer_lambda, adaptive = ma
    ref = official_code_reference(new, old, mask, adv, answer, lam, chunk, mask_answer, answer_lambda, adaptive, v_mean)
    gate = "action" if chunk else "response"
    if not mask_answer:
        cfg = LLDSConfig(lam=lam, gate=gate, norm="token_mean")
    elif adaptive:  # ω = answer_no_reduce_lambda / λ with the code's ramp
        cfg = LLDSConfig(lam=lam, gate=gate, norm="token_mean", answer_weight=answer_lambda / lam, adaptive_beta="code")
    else:  # fixed: β = min(answer_no_reduce_lambda, λ) / λ
        cfg = LLDSConfig(lam=lam, gate=gate, norm="token_mean", answer_weight=min(answer_lambda, lam) / lam)
    loss, _ = llds_loss(new, old, adv, mask, cfg, answer_mask=answer, valid_searches_mean=v_mean)
    assert math.isclose(cfg.lam * loss.item(), ref, rel_tol=1e-5, abs_tol=1e-7), (cfg, loss.item(), ref)


# ---------------------------------------------------------------------------------------------- the authors' code
def dp_actor_llds(new, old, mask, adv, answer, lam, chunk, mask_weight):
    """The LLDS term as the authors' `dp_actor.py` computes it, in torch ops (paper.md §4.1): d = old − new,
    base = torch.maximum(d, 0); the advantage's sign read per token (A tiled over the response); chunks of
    response_mask·[A≥0] summed (A-gate) or the response's signed sum (R-gate), active when > 0; coeff = λ off the
    answer span and min(mask_weight, λ) on it; loss = Σ penalty / Σ response_mask (λ folded in)."""
    m = mask.float()
    adv_tok = adv.unsqueeze(1).expand_as(new)
    keep = m * (adv_tok >= 0).float()
    d = torch.where(mask, old - new, torch.zeros_like(new))
    base = torch.maximum(d, torch.zeros_like(d))
    if chunk:
        run = action_index(keep.bool())
        n_runs = int(run.max()) + 1 if run.numel() and run.max() >= 0 else 0
        sums = torch.zeros(new.shape[0], max(n_runs, 1)).scatter_add(1, run.clamp(min=0), d * keep)
        flag = torch.where(run >= 0, sums.gather(1, run.clamp(min=0)) > 0, torch.zeros_like(keep, dtype=torch.bool))
    else:
        flag = ((d * keep).sum(-1, keepdim=True) > 0).expand_as(keep)
    coeff = torch.where(answer, torch.full_like(m, min(mask_weight, lam)), torch.full_like(m, lam))
    return (flag.float() * keep * base * coeff).sum() / m.sum().clamp(min=1)


def _random_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 20
    mask = torch.rand(b, t, generator=gen) < 0.8
    old = -torch.rand(b, t, generator=gen) * 3
    new = old + torch.randn(b, t, generator=gen) * 0.3
    adv = torch.randn(b, generator=gen)
    answer = (torch.rand(b, t, generator=gen) < 0.2) & mask
    return new, old, mask, adv, answer


def test_the_authors_llds_term_and_ours_agree_on_random_batches():
    """40 random batches (A-gate and R-gate, with and without the answer span's own coefficient β ≤ 1): our
    `llds_loss` with norm="token_mean" against the torch oracle of their `dp_actor.py`."""
    worst = 0.0
    for seed in range(40):
        new, old, mask, adv, answer = _random_case(seed)
        chunk = seed % 2 == 0
        lam, beta = 0.2, (0.5 if seed % 4 < 2 else 1.0)
        ours, _ = llds_loss(new, old, adv, mask, LLDSConfig(lam=lam, gate="action" if chunk else "response",
                                                             norm="token_mean", answer_weight=beta),
                            answer_mask=answer)
        theirs = dp_actor_llds(new, old, mask, adv, answer, lam, chunk, mask_weight=beta * lam)
        worst = max(worst, abs(lam * ours.item() - theirs.item()))
    print(f"\nlargest |ours - theirs| over 40 random batches: {worst:.3g}")
    assert worst < 1e-7


def test_where_the_authors_code_and_ours_differ():
    """What docs/lld.md lists: at d = 0 exactly their torch.maximum splits the gradient (half each way), our relu
    gives none; their answer coefficient is capped at λ, ours takes β > 1; they read the advantage's sign per
    token, we per response (the same while the loss mask lies inside the attention mask)."""
    # 1. d = 0 on one scored token: the gradient of their term is -½·coeff/N there, ours 0
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.5]])  # d = 0 on token 0, d = 0.5 (a fall) on token 1
    mask, adv, answer = torch.ones(1, 2, dtype=torch.bool), torch.tensor([1.0]), torch.zeros(1, 2, dtype=torch.bool)
    dp_actor_llds(new, old, mask, adv, answer, 0.2, chunk=False, mask_weight=0.2).backward()
    theirs = new.grad.clone()
    new.grad = None
    ours, _ = llds_loss(new, old, adv, mask, LLDSConfig(lam=0.2, gate="response", norm="token_mean"))
    (0.2 * ours).backward()
    assert theirs[0, 0].item() == pytest.approx(-0.5 * 0.2 / 2) and new.grad[0, 0].item() == 0.0
    assert theirs[0, 1].item() == pytest.approx(new.grad[0, 1].item())  # elsewhere the same
    # 2. β > 1: accepted by ours (the answer span weighs more than λ), capped at λ by theirs
    new2, old2, mask2, adv2, answer2 = _random_case(3)
    big, _ = llds_loss(new2, old2, adv2, mask2, LLDSConfig(lam=0.2, gate="action", norm="token_mean", answer_weight=2.0),
                       answer_mask=answer2)
    one, _ = llds_loss(new2, old2, adv2, mask2, LLDSConfig(lam=0.2, gate="action", norm="token_mean", answer_weight=1.0),
                       answer_mask=answer2)
    capped = dp_actor_llds(new2, old2, mask2, adv2, answer2, 0.2, chunk=True, mask_weight=2.0 * 0.2)
    assert big.item() > one.item() and capped.item() == pytest.approx(0.2 * one.item(), abs=1e-7)
