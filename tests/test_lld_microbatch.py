"""LLDS over micro-batches (issue 29, item 4): with the global batch's normalizer, the micro-batch values add up to
the global batch's value for every norm, so the effective λ does not depend on the micro-batch size or composition.

Hand case (the issue's): 8 responses of 2 action tokens, Â = [1, .5, 1, -1, 0, -1, -1, -.5], so Y_pre = {0, 1, 2, 4}
(4 preserved). Every action token fell by d = 0.1 (ln π_old − ln π_new), so every gate is open and every preserved
response's per-token mean penalty is 0.1. Micro-batches of 2: {0,1} {2,3} {4,5} {6,7} hold 2, 1, 1, 0 preserved.

    response   (paper): global = (0.1 + 0.1 + 0.1 + 0.1) / 4          = 0.1
                        verl's old scaling, Σ (2/8) · L_micro = (2/8)(0.1 + 0.1 + 0.1 + 0) = 0.075  (the bug)
                        with normalizer = 4: Σ micro (Σ_pre per-resp mean) / 4 = (0.2 + 0.1 + 0.1 + 0) / 4 = 0.1
    token_mean (code):  global = 8 penalized tokens × 0.1 / 16 tokens = 0.05 ; pieces (0.4 + 0.2 + 0.2 + 0)/16 = 0.05
    seq_mean:           global = 0.4 / 8 responses                    = 0.05 ; pieces (0.2 + 0.1 + 0.1 + 0)/8  = 0.05
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lld_monitor.lld import NORMS, LLDSConfig, llds_loss, llds_normalizer

ADV = torch.tensor([1.0, 0.5, 1.0, -1.0, 0.0, -1.0, -1.0, -0.5])
MICRO = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]


def hand_batch():
    new = torch.full((8, 2), -1.0, requires_grad=True)
    old = new.detach() + 0.1  # d = old - new = 0.1 on every token
    mask = torch.ones(8, 2, dtype=torch.bool)
    return new, old, mask


@pytest.mark.parametrize(("norm", "glob", "count"), [("response", 0.1, 4), ("token_mean", 0.05, 16), ("seq_mean", 0.05, 8)])
def test_issue_case_by_hand(norm, glob, count):
    new, old, mask = hand_batch()
    cfg = LLDSConfig(norm=norm)
    whole, st = llds_loss(new, old, ADV, mask, cfg)
    assert whole.item() == pytest.approx(glob, rel=1e-6)
    assert llds_normalizer(ADV, mask, norm) == count
    assert sum(llds_normalizer(ADV[s], mask[s], norm) for s in MICRO) == count
    pieces = [llds_loss(new[s], old[s], ADV[s], mask[s], cfg, normalizer=count)[0] for s in MICRO]
    assert sum(pieces).item() == pytest.approx(glob, rel=1e-6)


def test_issue_case_old_scaling_was_off():
    """What the verl loss did before: each micro-batch's own response-norm value times B_micro / B = 0.075, not 0.1."""
    new, old, mask = hand_batch()
    cfg = LLDSConfig(norm="response")
    old_sum = sum(float(llds_loss(new[s], old[s], ADV[s], mask[s], cfg)[0]) * 2 / 8 for s in MICRO)
    assert old_sum == pytest.approx(0.075, rel=1e-6)


def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 12, 9
    new = (-torch.rand(b, t, generator=g) * 3).requires_grad_(True)
    old = new.detach() + torch.randn(b, t, generator=g) * 0.3
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[3] = False  # a response without any action token
    adv = torch.randn(b, generator=g)
    adv[5] = 0.0
    answer = torch.rand(b, t, generator=g) > 0.7
    cuts = sorted(torch.randperm(b - 1, generator=g)[:3].add(1).tolist())
    bounds = [0, *cuts, b]
    return new, old, mask, adv, answer, [slice(a, z) for a, z in itertools.pairwise(bounds)]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("gate", ["action", "response", "token"])
@pytest.mark.parametrize("beta", [None, 0.25])
def test_micro_batch_pieces_sum_to_the_global_value_and_gradient(norm, gate, beta):
    for seed in range(4):
        new, old, mask, adv, answer, micro = _random_case(seed)
        cfg = LLDSConfig(norm=norm, gate=gate, answer_weight=beta)
        kw = {"answer_mask": answer} if beta is not None else {}
        whole, _ = llds_loss(new, old, adv, mask, cfg, **kw)
        (g_whole,) = torch.autograd.grad(whole, new)
        n = sum(llds_normalizer(adv[s], mask[s], norm) for s in micro)
        assert n == llds_normalizer(adv, mask, norm)
        total = sum(
            llds_loss(new[s], old[s], adv[s], mask[s], cfg, normalizer=n,
                      **({"answer_mask": answer[s]} if beta is not None else {}))[0]
            for s in micro
        )
        (g_pieces,) = torch.autograd.grad(total, new)
        assert float(whole) > 0
        assert float(total) == pytest.approx(float(whole), rel=1e-5)
        assert torch.allclose(g_pieces, g_whole, rtol=1e-5, atol=1e-8)


def test_normalizer_is_the_batch_count_by_default_and_checked():
    new, old, mask, adv, _, _ = _random_case(7)
    for norm in NORMS:
        cfg = LLDSConfig(norm=norm)
        own, _ = llds_loss(new, old, adv, mask, cfg)
        given, _ = llds_loss(new, old, adv, mask, cfg, normalizer=llds_normalizer(adv, mask, norm))
        assert float(given) == pytest.approx(float(own), rel=1e-6)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="normalizer"):
            llds_loss(new, old, adv, mask, LLDSConfig(), normalizer=bad)
    with pytest.raises(ValueError, match="norm"):
        llds_normalizer(adv, mask, "tokens")
