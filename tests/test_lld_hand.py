"""Hand-computed LLD tests: every mask, Δ aggregate and gate loss below is worked out in the comments.

The fixture: 4 responses (B = 4) over T = 12 response positions. "A" = action token, "t" = tool /
observation token, "." = right padding. Responses 0 and 1 have the issue's 2 × 3-action shape; 2 and 3
add the all-tool case and an untrained-group (Â = 0) response where the R-gate and A-gate disagree.

    pos:        0  1  2  3  4  5  6  7  8  9 10 11
    row 0/1:    A  A  t  t  A  A  t  A  A  A  A  .      actions: A0={0,1} A1={4,5} A2={7,8,9,10}
    row 2:      t  t  t  t  t  t  t  t  t  t  t  .      no action token at all
    row 3:      A  A  t  t  A  A  t  A  A  .  .  .      actions: A0={0,1} A1={4,5} A2={7,8}

Answer tags: open = [50], close = [51, 52] (a two-token close tag). Rows 0 and 1 end with
"<answer>(50) x(60) </answer>(51 52)" at positions 7..10, so their answer span is {7, 8, 9, 10}.
Row 2 has the same ids inside its *observation* (ignored), row 3 has no tags.

d = ln π_old − ln π_new (> 0: the likelihood fell); the displayed Δ = −d.
    row 0 (Â = +1): d = A0 [+0.25, −0.75]  A1 [+0.75, −0.25]  A2 [+0.5, +0.25, −0.5, +0.25]
    row 1 (Â = −1): d = +0.5 on all 8 action tokens
    row 2 (Â = +1): no action tokens
    row 3 (Â =  0): d = A0 [+1.0, +0.5]    A1 [−1.0, −1.0]    A2 [+0.25, −0.5]
Log-probs on tool / padding positions are NaN (tool tokens have no log-prob): they must be ignored.
All values are dyadic, so every float32 operation below is exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from lld_monitor.lld import (
    LLDSConfig,
    action_index,
    answer_span_mask,
    displacement,
    displacement_summary,
    llds_loss,
)

NAN = float("nan")
OPEN, CLOSE = [50], [51, 52]
T = 12

MASK_01 = [1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0]
MASK_2 = [0] * T
MASK_3 = [1, 1, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0]

# d per position (None = not an action token)
D_ROWS = [
    [0.25, -0.75, None, None, 0.75, -0.25, None, 0.5, 0.25, -0.5, 0.25, None],
    [0.5, 0.5, None, None, 0.5, 0.5, None, 0.5, 0.5, 0.5, 0.5, None],
    [None] * T,
    [1.0, 0.5, None, None, -1.0, -1.0, None, 0.25, -0.5, None, None, None],
]
ADV = torch.tensor([1.0, -1.0, 1.0, 0.0])
IDS = torch.tensor(
    [
        [11, 12, 90, 91, 13, 14, 92, 50, 60, 51, 52, 0],
        [11, 12, 90, 91, 13, 14, 92, 50, 60, 51, 52, 0],
        [90, 91, 92, 93, 94, 50, 60, 51, 52, 95, 96, 0],
        [11, 12, 90, 91, 13, 14, 92, 15, 16, 0, 0, 0],
    ]
)
LOGP_OLD_VALUE = -1.5


def _fixture(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([MASK_01, MASK_01, MASK_2, MASK_3], dtype=torch.bool)
    old = torch.full((4, T), NAN)
    new = torch.full((4, T), NAN)
    for i, row in enumerate(D_ROWS):
        for j, d in enumerate(row):
            if d is not None:
                old[i, j] = LOGP_OLD_VALUE
                new[i, j] = LOGP_OLD_VALUE - d  # d = old − new
    assert torch.equal(mask, ~torch.isnan(old))
    new.requires_grad_(requires_grad)
    return new, old, mask


# ------------------------------------------------------------------------------------------ masks
def test_action_index_by_hand():
    _, _, mask = _fixture()
    expected = torch.tensor(
        [
            [0, 0, -1, -1, 1, 1, -1, 2, 2, 2, 2, -1],
            [0, 0, -1, -1, 1, 1, -1, 2, 2, 2, 2, -1],
            [-1] * T,
            [0, 0, -1, -1, 1, 1, -1, 2, 2, -1, -1, -1],
        ]
    )
    assert torch.equal(action_index(mask), expected)


def test_answer_span_mask_by_hand():
    _, _, mask = _fixture()
    expected = torch.zeros(4, T, dtype=torch.bool)
    expected[0, 7:11] = True  # "<answer> x </answer>" incl. both close-tag tokens
    expected[1, 7:11] = True
    # row 2: the tags sit in a tool observation -> ignored; row 3: no tags
    assert torch.equal(answer_span_mask(IDS, mask, OPEN, CLOSE), expected)


# ------------------------------------------------------------------------------------- Δ aggregates
def test_displacement_by_hand():
    new, old, mask = _fixture()
    s = displacement(new, old, mask)
    # Δ = −d per token, 0 off the mask (the NaN log-probs there are ignored)
    exp_tok = torch.zeros(4, T)
    for i, row in enumerate(D_ROWS):
        for j, d in enumerate(row):
            if d is not None:
                exp_tok[i, j] = -d
    assert torch.equal(s.token, exp_tok)
    # per action Δ sums:
    #   row 0: A0 −0.25+0.75 = 0.5 ; A1 −0.75+0.25 = −0.5 ; A2 −0.5−0.25+0.5−0.25 = −0.5
    #   row 1: A0 −1.0 ; A1 −1.0 ; A2 4×(−0.5) = −2.0
    #   row 2: nothing (action_valid all False, sums 0)
    #   row 3: A0 −1.0−0.5 = −1.5 ; A1 +1+1 = 2.0 ; A2 −0.25+0.5 = 0.25
    assert s.action_sum.tolist() == [[0.5, -0.5, -0.5], [-1.0, -1.0, -2.0], [0.0, 0.0, 0.0], [-1.5, 2.0, 0.25]]
    assert s.action_valid.tolist() == [[True] * 3, [True] * 3, [False] * 3, [True] * 3]
    assert s.action_len.tolist() == [[2, 2, 4], [2, 2, 4], [0, 0, 0], [2, 2, 2]]
    # response sums: row 0 0.5−0.5−0.5 = −0.5 ; row 1 −4.0 ; row 2 0 ; row 3 −1.5+2+0.25 = 0.75
    assert s.response_sum.tolist() == [-0.5, -4.0, 0.0, 0.75]
    # length-normalized: −0.5/8 = −0.0625 ; −4/8 = −0.5 ; 0 (no tokens) ; 0.75/6 = 0.125
    assert s.response_mean.tolist() == [-0.0625, -0.5, 0.0, 0.125]
    assert s.n_tokens.tolist() == [8, 8, 0, 6]
    assert s.n_actions.tolist() == [3, 3, 0, 3]


def test_displacement_summary_by_hand():
    new, old, mask = _fixture()
    out = displacement_summary(displacement(new, old, mask), ADV)
    # preserved = Â ≥ 0 with ≥ 1 action token = rows 0 and 3 (row 2 has no action token, row 1 Â < 0)
    assert out["n_preserved"] == 2 and out["n_preserved_actions"] == 6
    assert out["delta_preserved"] == (-0.5 + 0.75) / 2  # 0.125
    assert out["delta_preserved_mean"] == (-0.0625 + 0.125) / 2  # 0.03125
    assert out["frac_responses_displaced"] == 1 / 2  # row 0 fell, row 3 rose
    # row 0: A1, A2 fell (−0.5, −0.5); row 3: A0 fell (−1.5) -> 3 of 6 actions
    assert out["frac_actions_displaced"] == 3 / 6


def test_displacement_summary_empty_is_nan_not_zero():
    new, old, mask = _fixture()
    out = displacement_summary(displacement(new, old, mask), torch.tensor([-1.0, -1.0, 1.0, -0.5]))
    # only row 2 has Â ≥ 0 and it has no action token: nothing to average
    for key in ("delta_preserved", "delta_preserved_mean", "frac_actions_displaced", "frac_responses_displaced"):
        assert math.isnan(out[key]), key
    assert out["n_preserved"] == 0


# ------------------------------------------------------------------------------------- LLDS gates
# Penalties Σ g·max(0, d) per row (β = 1):
#   A-gate: row 0: A0 sum d = 0.25−0.75 = −0.5 ≤ 0 -> closed (its rising-sum action is never
#           penalized even though token 0 fell); A1 sum 0.5 > 0 -> open, only the falling token 4
#           counts: 0.75; A2 sum 0.5 > 0 -> open: 0.5+0.25+0+0.25 = 1.0 -> row 0 = 1.75
#           row 1: Â < 0 -> 0 (never penalized) ; row 2: no tokens -> 0
#           row 3: A0 sum 1.5 -> 1.0+0.5 = 1.5 ; A1 sum −2 closed ; A2 sum −0.25 closed -> 1.5
#   R-gate: row 0: Σd = −0.5+0.5+0.5 = 0.5 > 0 -> open: 0.25+0.75+1.0 = 2.0
#           row 3: Σd = 1.5−2−0.25 = −0.75 -> closed -> 0
#   token:  row 0: 0.25+0.75+1.0 = 2.0 ; row 3: 1.5+0.25 = 1.75
# norm="response" (paper): mean over Y_pre = {0, 3} of penalty / action tokens (8 and 6)
# norm="token_mean" (code): Σ penalty / all 22 action tokens (8+8+0+6, the Â<0 row 1 included)
HAND = {
    ("action", "response"): (1.75 / 8 + 1.5 / 6) / 2,  # 0.234375
    ("action", "token_mean"): (1.75 + 1.5) / 22,
    ("response", "response"): (2.0 / 8 + 0.0) / 2,  # 0.125
    ("response", "token_mean"): 2.0 / 22,
    ("token", "response"): (2.0 / 8 + 1.75 / 6) / 2,
    ("token", "token_mean"): (2.0 + 1.75) / 22,
}
# tokens with a positive penalty; open actions; open responses
HAND_COUNTS = {
    "action": (6, 3, 2),  # row 0: 4, 7, 8, 10 ; row 3: 0, 1 | row 0 A1, A2 ; row 3 A0 | rows 0, 3
    "response": (5, 3, 1),  # row 0: 0, 4, 7, 8, 10 | row 0 A0, A1, A2 | row 0
    "token": (8, 5, 2),  # row 0: 0, 4, 7, 8, 10 ; row 3: 0, 1, 7 | 0:A0 A1 A2, 3:A0 A2 | rows 0, 3
}


@pytest.mark.parametrize("gate,norm", sorted(HAND))
def test_llds_gates_by_hand(gate, norm):
    new, old, mask = _fixture()
    loss, st = llds_loss(new, old, ADV, mask, LLDSConfig(gate=gate, norm=norm))
    assert loss.item() == pytest.approx(HAND[(gate, norm)], abs=1e-7)
    assert st["llds_raw"] == pytest.approx(HAND[(gate, norm)], abs=1e-7)
    n_tok, n_act, n_resp = HAND_COUNTS[gate]
    assert (st["n_penalized_tokens"], st["n_gated_actions"], st["n_gated_responses"]) == (n_tok, n_act, n_resp)
    assert st["n_preserved"] == 2 and st["beta"] == 1.0


def test_likelihood_rose_everywhere_no_penalty():
    new, old, mask = _fixture()
    risen = torch.where(mask, old + 0.5, old)  # every action token gained 0.5 nats: d = −0.5
    for gate in ("action", "response", "token"):
        loss, st = llds_loss(risen, old, ADV, mask, LLDSConfig(gate=gate))
        assert loss.item() == 0.0 and st["n_penalized_tokens"] == 0 and st["n_gated_actions"] == 0


def test_negative_advantage_never_penalized():
    new, old, mask = _fixture()
    # all advantages negative: row 1's d = +0.5 everywhere, rows 0/3 have falling tokens too
    for gate in ("action", "response", "token"):
        for norm in ("response", "token_mean"):
            loss, st = llds_loss(new, old, -ADV.abs() - 0.1, mask, LLDSConfig(gate=gate, norm=norm))
            assert loss.item() == 0.0 and st["n_preserved"] == 0 and st["n_penalized_tokens"] == 0


def test_all_tool_tokens_nothing_counted():
    new, old, mask = _fixture()
    # only row 2 (all tool tokens, Â = +1) on its own: no action token -> nothing counted, no NaN
    for norm in ("response", "token_mean"):
        loss, st = llds_loss(new[2:3], old[2:3], ADV[2:3], mask[2:3], LLDSConfig(norm=norm))
        assert loss.item() == 0.0 and st["n_preserved"] == 0 and st["n_gated_actions"] == 0
    s = displacement(new[2:3], old[2:3], mask[2:3])
    assert s.response_sum.tolist() == [0.0] and s.n_tokens.tolist() == [0] and not s.action_valid.any()


# ------------------------------------------------------------------------------------- LLDS-MA
# answer span = row 0 positions 7..10 (row 1's span has Â < 0 anyway). Row 0's A2 is open (sum 0.5);
# its penalty 1.0 = 0.5 (pos 7) + 0.25 (pos 8) + 0.25 (pos 10) becomes β·1.0; the gate itself uses
# the unweighted d. Row 0 A-gate penalty = 0.75 + β·1.0, row 3 unchanged (1.5).
def _ma_expected(beta: float) -> float:
    return ((0.75 + beta * 1.0) / 8 + 1.5 / 6) / 2


@pytest.mark.parametrize(
    "cfg_kwargs,vsm,beta",
    [
        ({"answer_weight": 0.0}, None, 0.0),  # β = 0: the answer span is exempt -> (0.75/8 + 0.25)/2
        ({"answer_weight": 0.5}, None, 0.5),
        ({"answer_weight": 1.0}, None, 1.0),  # β = 1 == plain LLDS
        ({"adaptive_beta": "paper"}, 1.0, 0.5),  # paper: min(1/2, 1)
        ({"adaptive_beta": "paper"}, 3.0, 1.0),  # paper: min(3/2, 1)
        ({"adaptive_beta": "paper"}, 0.0, 0.0),
        ({"adaptive_beta": "code"}, 1.0, 0.0),  # code: min(max(1−1, 0), 1)
        ({"adaptive_beta": "code"}, 1.5, 0.5),  # code: min(max(0.5, 0), 1)
        ({"adaptive_beta": "code"}, 2.5, 1.0),
        ({"adaptive_beta": "code", "answer_weight": 0.5}, 2.0, 0.5),  # code multiplier ω: min(0.5·1, 1)
        ({"adaptive_beta": "code", "answer_weight": 0.5}, 3.0, 1.0),  # min(0.5·max(3−1, 0), 1): ramp uncapped
        ({"adaptive_beta": "paper", "answer_weight": 0.5}, 3.0, 0.75),  # min(0.5·3/2, 1)
    ],
)
def test_llds_ma_by_hand(cfg_kwargs, vsm, beta):
    new, old, mask = _fixture()
    am = answer_span_mask(IDS, mask, OPEN, CLOSE)
    loss, st = llds_loss(new, old, ADV, mask, LLDSConfig(**cfg_kwargs), answer_mask=am, valid_searches_mean=vsm)
    assert st["beta"] == beta
    assert loss.item() == pytest.approx(_ma_expected(beta), abs=1e-7)
    # penalized tokens: row 0 pos 4 (+ 7, 8, 10 when β > 0), row 3 pos 0, 1
    assert st["n_penalized_tokens"] == (6 if beta > 0 else 3)
    # gates are unchanged by β
    assert st["n_gated_actions"] == 3


def test_beta_zero_exact_value():
    new, old, mask = _fixture()
    am = answer_span_mask(IDS, mask, OPEN, CLOSE)
    loss, _ = llds_loss(new, old, ADV, mask, LLDSConfig(answer_weight=0.0), answer_mask=am)
    assert loss.item() == 0.171875  # (0.75/8 + 1.5/6)/2 = (0.09375 + 0.25)/2, exact in float32


def test_llds_ma_token_mean_by_hand():
    new, old, mask = _fixture()
    am = answer_span_mask(IDS, mask, OPEN, CLOSE)
    loss, _ = llds_loss(new, old, ADV, mask, LLDSConfig(norm="token_mean", answer_weight=0.0), answer_mask=am)
    assert loss.item() == pytest.approx((0.75 + 1.5) / 22, abs=1e-7)


def test_llds_ma_needs_its_inputs():
    new, old, mask = _fixture()
    with pytest.raises(ValueError, match="answer_mask"):
        llds_loss(new, old, ADV, mask, LLDSConfig(answer_weight=0.0))
    am = answer_span_mask(IDS, mask, OPEN, CLOSE)
    with pytest.raises(ValueError, match="valid_searches_mean"):
        llds_loss(new, old, ADV, mask, LLDSConfig(adaptive_beta="paper"), answer_mask=am)


def test_verl_style_token_advantages_match():
    new, old, mask = _fixture()
    tiled = ADV.unsqueeze(1).expand(4, T)
    a, _ = llds_loss(new, old, ADV, mask)
    b, _ = llds_loss(new, old, tiled, mask)
    assert a.item() == b.item()


# ------------------------------------------------------------------------------------- gradients
# ∂L/∂ln π_new = −g·w / (|Y_pre| · n_i) on penalized tokens, exactly 0 elsewhere.
def test_llds_gradient_by_hand_response_norm():
    new, old, mask = _fixture(requires_grad=True)
    loss, _ = llds_loss(new, old, ADV, mask, LLDSConfig(gate="action"))
    loss.backward()
    g = new.grad
    assert torch.isfinite(g).all()  # NaN log-probs on tool tokens do not leak into the gradient
    expected = torch.zeros(4, T)
    for j in (4, 7, 8, 10):
        expected[0, j] = -1.0 / (2 * 8)  # −0.0625
    for j in (0, 1):
        expected[3, j] = -1.0 / (2 * 6)
    assert torch.allclose(g, expected, atol=1e-8, rtol=0)
    assert (g[expected == 0] == 0).all()  # exactly zero, not just small


def test_llds_gradient_by_hand_token_mean_and_beta():
    new, old, mask = _fixture(requires_grad=True)
    am = answer_span_mask(IDS, mask, OPEN, CLOSE)
    loss, _ = llds_loss(new, old, ADV, mask, LLDSConfig(norm="token_mean", answer_weight=0.5), answer_mask=am)
    loss.backward()
    expected = torch.zeros(4, T)
    expected[0, 4] = -1.0 / 22
    for j in (7, 8, 10):
        expected[0, j] = -0.5 / 22  # β = 0.5 on the answer span
    expected[3, 0] = expected[3, 1] = -1.0 / 22
    assert torch.allclose(new.grad, expected, atol=1e-8, rtol=0)
    assert (new.grad[expected == 0] == 0).all()


def test_llds_step_raises_likelihood_of_penalized_tokens():
    """A real gradient step on logits: the LLDS term alone raises ln π of the penalized tokens."""
    torch.manual_seed(0)
    b, t, v = 2, 6, 7
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    targets = torch.randint(0, v, (b, t))
    logits = torch.randn(b, t, v, requires_grad=True)
    from lld_monitor.lld import token_logprobs

    with torch.no_grad():
        lp0 = token_logprobs(logits, targets)
        # "old" policy: 0.3 nats above the current one on every token -> every token fell (d = 0.3)
        old = lp0 + 0.3
    adv = torch.tensor([1.0, -1.0])
    loss, st = llds_loss(token_logprobs(logits, targets), old, adv, mask)
    assert st["n_penalized_tokens"] == 5  # row 0's action tokens; row 1 has Â < 0
    loss.backward()
    with torch.no_grad():
        lp1 = token_logprobs(logits - 1.0 * logits.grad, targets)
    up = lp1 - lp0
    assert (up[0][mask[0]] > 1e-4).all()  # penalized tokens: likelihood pushed up
    assert torch.equal(logits.grad[1], torch.zeros(t, v))  # Â < 0 row: no gradient at all
    assert torch.equal(logits.grad[0][~mask[0]], torch.zeros(1, v))  # tool token: no gradient


def test_verl_style_advantages_zero_off_mask():
    # verl tiles Â over the response and zeroes it on padding; a row whose first position is not an
    # action token must still be read at its first action token
    new, old, mask = _fixture()
    new2 = torch.cat([torch.full((4, 1), NAN), new], 1)
    old2 = torch.cat([torch.full((4, 1), NAN), old], 1)
    mask2 = torch.cat([torch.zeros(4, 1, dtype=torch.bool), mask], 1)
    tiled = torch.cat([torch.zeros(4, 1), ADV.unsqueeze(1).expand(4, T) * mask], 1)
    a, sa = llds_loss(new, old, ADV, mask)
    b, sb = llds_loss(new2, old2, tiled, mask2)
    assert a.item() == b.item() == HAND[("action", "response")] and sa == sb
    assert displacement_summary(displacement(new2, old2, mask2), tiled) == displacement_summary(
        displacement(new, old, mask), ADV
    )


def test_nan_advantages_rejected():
    new, old, mask = _fixture()
    with pytest.raises(ValueError, match="NaN"):
        llds_loss(new, old, torch.tensor([1.0, NAN, 0.0, 1.0]), mask)


def test_displacement_summary_correct_probe_by_hand():
    new, old, mask = _fixture()
    # correct = rows 0 and 2; row 2 has no action token -> only row 0 (Σ Δ = −0.5, mean −0.0625)
    out = displacement_summary(displacement(new, old, mask), ADV, correct=torch.tensor([True, False, True, False]))
    assert out["n_correct"] == 1
    assert out["delta_correct"] == -0.5 and out["delta_correct_mean"] == -0.0625
    assert out["frac_correct_displaced"] == 1.0
    assert out["delta_preserved"] == 0.125  # unchanged by the extra argument
    none = displacement_summary(displacement(new, old, mask), ADV, correct=torch.zeros(4, dtype=torch.bool))
    assert math.isnan(none["delta_correct"]) and none["n_correct"] == 0
