"""Log-probs / entropy numerics, GRPO advantages, PPO-clip with k3 KL, answer-span edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from lld_monitor.lld import (
    answer_beta,
    answer_span_mask,
    grpo_advantages,
    logprobs_and_entropy,
    ppo_clip_loss,
    token_entropy,
    token_logprobs,
)

LN3 = math.log(3.0)


# ------------------------------------------------------------------------------ log-probs, entropy
def test_logprobs_and_entropy_by_hand():
    # logits [0, ln 3] -> p = [1/4, 3/4]
    logits = torch.tensor([[[0.0, LN3]]])
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75), abs=1e-7)
    assert token_logprobs(logits, torch.tensor([[0]])).item() == pytest.approx(math.log(0.25), abs=1e-7)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert token_entropy(logits).item() == pytest.approx(h, abs=1e-7)


def test_temperature_divides_logits():
    # logits [0, 2 ln 3] at temperature 2 are [0, ln 3] -> p = [1/4, 3/4]
    logits = torch.tensor([[[0.0, 2 * LN3]]])
    lp, h = logprobs_and_entropy(logits, torch.tensor([[1]]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert h.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(logits, torch.tensor([[1]]), temperature=bad)


def test_entropy_with_minus_inf_logits_no_nan_value_or_grad():
    # a masked-out vocabulary entry (−inf) has p = 0 and contributes 0 to the entropy
    logits = torch.tensor([[[0.0, float("-inf"), LN3]]], requires_grad=True)
    lp, h = logprobs_and_entropy(logits, torch.tensor([[2]]))
    assert h.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    (h.sum() + lp.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 1].item() == 0.0


def test_bf16_logits_computed_in_float32():
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 1000) * 8).bfloat16()
    targets = torch.randint(0, 1000, (3, 5))
    lp, h = logprobs_and_entropy(logits, targets)
    assert lp.dtype == torch.float32 and h.dtype == torch.float32
    ref = torch.log_softmax(logits.double(), dim=-1)
    ref_lp = ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_h = -(ref.exp() * ref).sum(-1)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-4, rtol=0)
    assert torch.allclose(h.double(), ref_h, atol=1e-4, rtol=0)
    # a bf16 log-softmax would be off by ~1e-2 here: prove the float32 path matters
    naive = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()
    assert (naive - ref_lp).abs().max() > (lp.double() - ref_lp).abs().max()


def test_huge_logits_are_stable():
    logits = torch.tensor([[[8192.0, -8192.0, 0.0]]]).bfloat16()  # exactly representable in bf16
    lp, h = logprobs_and_entropy(logits, torch.tensor([[1]]))
    assert torch.isfinite(h).all() and h.item() == pytest.approx(0.0, abs=1e-6)
    assert lp.item() == -16384.0


def test_logprob_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))


# ------------------------------------------------------------------------------ GRPO advantages
def test_grpo_advantages_by_hand():
    # group "a": [1, 0, 0, 1, 1]: mean 0.6, unbiased std = sqrt((3·0.16 + 2·0.36)/4) = sqrt(0.3)
    # group "b": [0.1, 0.1, 0.1] all equal -> exactly 0 ; group "c": singleton -> 0 (paper-consistent)
    r = torch.tensor([1.0, 0.1, 0.0, 0.1, 0.0, 5.0, 1.0, 0.1, 1.0])
    g = ["a", "b", "a", "b", "a", "c", "a", "b", "a"]
    adv = grpo_advantages(r, g)
    s = math.sqrt(0.3)
    exp = [0.4 / (s + 1e-6), 0, -0.6 / (s + 1e-6), 0, -0.6 / (s + 1e-6), 0, 0.4 / (s + 1e-6), 0, 0.4 / (s + 1e-6)]
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(exp, abs=1e-6)
    assert adv[[1, 3, 7]].tolist() == [0.0, 0.0, 0.0]  # exactly zero
    # matches torch.std (unbiased) on the group
    ga = r[[0, 2, 4, 6, 8]]
    assert adv[0].item() == pytest.approx(((ga[0] - ga.mean()) / (ga.std() + 1e-6)).item(), abs=1e-6)


def test_grpo_singleton_verl_and_population_std():
    r = torch.tensor([3.0, 1.0, 0.0])
    g = [7, 8, 8]
    assert grpo_advantages(r, g, singleton="verl").tolist()[0] == pytest.approx(3.0 / (1 + 1e-6))
    # population std of [1, 0] is 0.5 -> ±0.5/(0.5+eps)
    pop = grpo_advantages(r, g, unbiased=False)
    assert pop.tolist() == pytest.approx([0.0, 0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)], abs=1e-6)
    # unbiased std of [1, 0] is sqrt(0.5)
    unb = grpo_advantages(r, torch.tensor(g))
    assert unb[1].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-6)


def test_grpo_bad_input():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.tensor([1.0, 2.0]), ["a"])
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), ["a", "a"])
    with pytest.raises(ValueError, match="singleton"):
        grpo_advantages(torch.tensor([1.0]), ["a"], singleton="nope")


# ------------------------------------------------------------------------------ PPO-clip
def test_ppo_clip_by_hand():
    # four action tokens (+ one tool token with NaN log-probs), ε = 0.2:
    #   Â=+1, ratio 1.5 -> max(−1.5, −1.2) = −1.2 (clipped)
    #   Â=+1, ratio 0.5 -> max(−0.5, −0.8) = −0.5
    #   Â=−1, ratio 0.5 -> max(0.5, 0.8)  = 0.8 (clipped)
    #   Â=−1, ratio 1.5 -> max(1.5, 1.2)  = 1.5
    # pg = (−1.2 − 0.5 + 0.8 + 1.5)/4 = 0.15; clip_frac = 2/4; ratio_mean = 1.0
    old = torch.tensor([[-1.0, -1.0, float("nan")], [-1.0, -1.0, float("nan")]])
    new = torch.tensor([[-1.0 + math.log(1.5), -1.0 + math.log(0.5), float("nan")],
                        [-1.0 + math.log(0.5), -1.0 + math.log(1.5), float("nan")]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([1.0, -1.0])
    loss, st = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    assert st["pg_loss"] == pytest.approx(0.15, abs=1e-6)
    assert st["clip_frac"] == 0.5 and st["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and st["kl"] == 0.0
    loss.backward()
    # clipped tokens get no gradient; the others: ∂(−Â·ratio)/∂logp / 4 = −Â·ratio/4
    g = new.grad
    assert g[0, 0].item() == 0.0 and g[1, 0].item() == 0.0
    assert g[0, 1].item() == pytest.approx(-0.5 / 4, abs=1e-6)
    assert g[1, 1].item() == pytest.approx(1.5 / 4, abs=1e-6)
    assert g[0, 2].item() == 0.0 and g[1, 2].item() == 0.0


def test_ppo_k3_kl_by_hand_and_clamp():
    # k3 with δ = ln π_ref − ln π: e^δ − δ − 1. δ = ln 2 -> 2 − ln 2 − 1 ; δ = 0 -> 0 ; δ = 5 -> clamped 10
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.0 + math.log(2.0), -1.0, 4.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, st = ppo_clip_loss(logp, logp.clone(), torch.tensor([0.0]), mask, logp_ref=ref, kl_coef=0.1)
    k3 = ((1.0 - math.log(2.0)) + 0.0 + 10.0) / 3
    assert st["kl"] == pytest.approx(k3, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3, abs=1e-6)  # Â = 0 -> pg = 0
    with pytest.raises(ValueError, match="logp_ref"):
        ppo_clip_loss(logp, logp, torch.tensor([1.0]), mask, kl_coef=0.1)


def test_ppo_empty_mask_is_zero_not_nan():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, st = ppo_clip_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), torch.zeros(2, 3, dtype=torch.bool))
    assert loss.item() == 0.0 and st["clip_frac"] == 0.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_ppo_huge_ratio_finite():
    logp = torch.tensor([[100.0]], requires_grad=True)  # log-ratio 101 -> clamped at ln 100
    loss, st = ppo_clip_loss(logp, torch.tensor([[-1.0]]), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool))
    assert loss.item() == pytest.approx(100.0, rel=1e-5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


# ------------------------------------------------------------------------------ answer span
def _span(ids, mask=None, open_ids=(50,), close_ids=(51,)):
    ids_t = torch.tensor([ids])
    m = torch.ones_like(ids_t, dtype=torch.bool) if mask is None else torch.tensor([mask], dtype=torch.bool)
    return answer_span_mask(ids_t, m, list(open_ids), list(close_ids))[0].int().tolist()


def test_answer_span_edge_cases():
    # two closed spans -> the last one
    assert _span([50, 1, 51, 2, 50, 3, 51, 4]) == [0, 0, 0, 0, 1, 1, 1, 0]
    # a trailing unclosed <answer> after a closed span -> still the closed one
    assert _span([50, 1, 51, 50, 3]) == [1, 1, 1, 0, 0]
    # only an opening tag / close before open -> nothing
    assert _span([1, 50, 2, 3]) == [0, 0, 0, 0]
    assert _span([51, 1, 50, 2]) == [0, 0, 0, 0]
    # nested opens: the last open before the last close
    assert _span([50, 1, 50, 2, 51]) == [0, 0, 1, 1, 1]
    # span ending at the last position, empty content
    assert _span([9, 50, 51]) == [0, 1, 1]
    # multi-token tags on both sides: <answer> = [40, 41], </answer> = [40, 42]
    assert _span([40, 41, 7, 40, 42, 8], open_ids=(40, 41), close_ids=(40, 42)) == [1, 1, 1, 1, 1, 0]
    # a partial tag does not match
    assert _span([40, 7, 40, 42], open_ids=(40, 41), close_ids=(40, 42)) == [0, 0, 0, 0]
    # tags inside a tool observation are ignored; a tool token inside the span is excluded
    assert _span([50, 1, 51, 50, 2, 51], mask=[1, 1, 1, 0, 0, 0]) == [1, 1, 1, 0, 0, 0]
    assert _span([50, 1, 2, 51], mask=[1, 0, 1, 1]) == [1, 0, 1, 1]
    # tag longer than the row
    assert _span([40], open_ids=(40, 41), close_ids=(40, 42)) == [0]


def test_answer_span_errors():
    with pytest.raises(ValueError, match="non-empty"):
        answer_span_mask(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), [], [1])


# ------------------------------------------------------------------------------ β rules
def test_answer_beta_rules():
    assert [answer_beta(v, "paper") for v in (0.0, 1.0, 1.5, 2.0, 4.0)] == [0.0, 0.5, 0.75, 1.0, 1.0]
    assert [answer_beta(v, "code") for v in (0.0, 1.0, 1.5, 2.0, 4.0)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert answer_beta(3.0, "paper", v_base=4.0) == 0.75
    assert answer_beta(3.5, "code", v_base=3.0) == 1.0 and answer_beta(2.5, "code", v_base=3.0) == 0.5
    with pytest.raises(ValueError, match="rule"):
        answer_beta(1.0, "nope")
    with pytest.raises(ValueError, match="finite"):
        answer_beta(float("nan"))


def test_chunked_no_grad_path_matches_full(monkeypatch):
    import lld_monitor.lld as lld

    torch.manual_seed(1)
    logits = torch.randn(3, 7, 50).bfloat16()
    targets = torch.randint(0, 50, (3, 7))
    full_lp, full_h = logprobs_and_entropy(logits, targets, temperature=0.7)
    monkeypatch.setattr(lld, "_CHUNK_ELEMS", 120)  # 2 rows of 50 per chunk -> 11 chunks
    with torch.no_grad():
        lp, h = logprobs_and_entropy(logits, targets, temperature=0.7)
        assert torch.equal(token_logprobs(logits, targets, 0.7), lp) and torch.equal(token_entropy(logits, 0.7), h)
    assert torch.allclose(lp, full_lp, atol=1e-6) and torch.allclose(h, full_h, atol=1e-6)
    # with autograd the full graph path is used and gradients flow
    x = logits.float().requires_grad_(True)
    token_logprobs(x, targets).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_ppo_seq_mean_token_mean_by_hand():
    # Row 0: a long correct response (Â=+1, 3 action tokens), row 1: a short wrong one (Â=−1, 1 token),
    # row 2: only tool tokens (left out of the mean). All ratios 1 (no clipping).
    #   token_mean:          (−1 −1 −1 + 1)/4            = −0.5
    #   seq_mean_token_mean: ((−1 −1 −1)/3 + (1)/1) / 2  =  0.0
    # Gradients of the shared first token: token_mean −Â/4 each row; seq-mean −Â/(2·|o_i|): row 0
    # −1/6, row 1 +1/2 — the short wrong response's copy weighs 3× the long correct one's.
    logp = torch.full((3, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    adv = torch.tensor([1.0, -1.0, 0.5])
    lt, _ = ppo_clip_loss(logp, logp.detach(), adv, mask)
    assert lt.item() == pytest.approx(-0.5, abs=1e-6)
    ls, st = ppo_clip_loss(logp, logp.detach(), adv, mask, agg="seq_mean_token_mean")
    assert ls.item() == pytest.approx(0.0, abs=1e-6) and st["pg_loss"] == pytest.approx(0.0, abs=1e-6)
    ls.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1 / 6, abs=1e-6)
    assert logp.grad[1, 0].item() == pytest.approx(0.5, abs=1e-6)
    assert logp.grad[2].abs().sum().item() == 0.0 and logp.grad[1, 1:].abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="agg"):
        ppo_clip_loss(logp, logp.detach(), adv, mask, agg="sum")
