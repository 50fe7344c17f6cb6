"""The `llds` verl policy loss through verl's own micro-batch / data-parallel code paths (issue 29, items 2, 4, 6).

A mini-batch in verl's no-padding layout (`left_right_2_no_padding`, what the driver sends), split per rank and into
micro-batches by verl's `prepare_micro_batches`, each micro-batch through verl's `ppo_loss` (which calls the
registered `llds` loss), the per-micro-batch metrics collected by verl's `postprocess_batch_func` and aggregated
over two simulated data-parallel ranks by `Metric.aggregate_dp`, as `engine_workers.update_actor` does.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl", reason="verl is an optional extra (docs/integrations.md, 'Installing: two paths')")

from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import Metric  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from lld_monitor import lld  # noqa: E402
from lld_monitor.integrations.trainers import verl_loss  # noqa: E402

P, R = 3, 6  # prompt and response length


def mini_batch(adv: list[float], seed: int = 0, noise: float = 0.3) -> tuple[TensorDict, torch.Tensor]:
    """A padded verl mini-batch converted to verl's no-padding layout, and the current log-probs [B, R]."""
    g = torch.Generator().manual_seed(seed)
    b = len(adv)
    resp_len = torch.tensor([R - (i % 3) for i in range(b)])
    attn_resp = (torch.arange(R).unsqueeze(0) < resp_len.unsqueeze(1)).long()
    response_mask = attn_resp.clone()
    response_mask[1::2, 2] = 0  # a tool token inside every other response
    old = -torch.rand(b, R, generator=g) * 2
    new = old + torch.randn(b, R, generator=g) * noise
    td = TensorDict({
        "prompts": torch.randint(5, 50, (b, P), generator=g),
        "responses": torch.randint(5, 50, (b, R), generator=g),
        "input_ids": torch.randint(5, 50, (b, P + R), generator=g),
        "attention_mask": torch.cat([torch.ones(b, P, dtype=torch.long), attn_resp], 1),
        "position_ids": torch.arange(P + R).expand(b, P + R).clone(),
        "response_mask": response_mask,
        "old_log_probs": old * attn_resp,
        "advantages": torch.tensor(adv).unsqueeze(1) * attn_resp,
    }, batch_size=[b])
    return left_right_2_no_padding(td), new * attn_resp


def model_output(micro: TensorDict, new: torch.Tensor) -> dict:
    """The engine's no-padding `log_probs` for a micro-batch: per sequence, position t holds ln π of token t+1, so
    `no_padding_2_padding` reads the response log-probs back from positions P-1 ... P+r-2."""
    seqs = []
    lens = micro["attention_mask"].sum(1)
    for i in range(new.shape[0]):
        v = torch.zeros(int(lens[i]))
        r = int(lens[i]) - P
        v[P - 1 : P - 1 + r] = new[i, :r]
        seqs.append(v)
    return {"log_probs": torch.nested.as_nested_tensor(seqs, layout=torch.jagged)}


def actor_config(**llds) -> ActorConfig:
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                       use_dynamic_bsz=False,
                       policy_loss=verl_loss.LLDSPolicyLossConfig(loss_mode="llds", **llds))


def run_mini_batch(data: TensorDict, new: torch.Tensor, config: ActorConfig, dp: int, micro: int):
    """verl's update of one mini-batch over `dp` simulated ranks: returns (per-rank list of micro-batch losses,
    the metrics aggregated over ranks as engine_workers.update_actor does)."""
    b = data.batch_size[0]
    n_tok = int(data["response_mask"].sum())
    per_rank = b // dp
    losses, rank_metrics = [], []
    for rank in range(dp):
        idx = torch.arange(rank * per_rank, (rank + 1) * per_rank)
        part = tu.index_select_tensor_dict(data, idx)
        part_new = new[idx]
        tu.assign_non_tensor(part, dp_size=dp, batch_num_tokens=n_tok, global_batch_size=b, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=micro)
        micro_batches, _ = prepare_micro_batches(part)
        outs, rank_losses = [], []
        for k, mb in enumerate(micro_batches):
            loss, metrics = ppo_loss(config, model_output(mb, part_new[k * micro : (k + 1) * micro]), mb)
            rank_losses.append(loss)
            outs.append({"loss": loss, "metrics": metrics})
        losses.append(rank_losses)
        rank_metrics.append(postprocess_batch_func(output_lst=outs, indices=None, data=part)["metrics"])
    keys = set(rank_metrics[0])
    assert all(set(m) == keys for m in rank_metrics), "every rank must return the same metric keys"
    aggregated = {}
    for key in keys:
        vals = [m[key] for m in rank_metrics]
        aggregated[key] = Metric.aggregate_dp(vals) if isinstance(vals[0], Metric) else vals
    return losses, aggregated


# ranks' micro-batches: rank 0 = rows 0-3 -> micro {0,1} (Â ≥ 0, Â ≥ 0) and {2,3} (no Â ≥ 0); rank 1 = rows 4-7
ADV = [1.0, 0.5, -1.0, -0.5, 0.0, -1.0, 1.0, -1.0]


def test_metric_aggregation_over_two_ranks_with_a_micro_batch_without_preserved_responses():
    """The issue's crash: a micro-batch with no Â ≥ 0 response made rank 0 drop `lld/delta_preserved` once, and
    `Metric.aggregate_dp` raised 'All Metric instances must have the same number of values ... [2, 1]'."""
    data, new = mini_batch(ADV)
    _, agg = run_mini_batch(data, new, actor_config(), dp=2, micro=2)
    for key in verl_loss.METRIC_KEYS:
        assert key in agg and agg[key] == agg[key], key  # present and not NaN
    assert agg["lld/frac_preserved"] == pytest.approx(4 / 8)
    assert agg["lld/llds_loss"] > 0 and agg["lld/llds_noise_gated"] == 0


@pytest.mark.parametrize("norm", verl_loss.VERL_NORMS)
@pytest.mark.parametrize(("dp", "micro"), [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4)])
def test_micro_batch_terms_add_up_to_the_mini_batch_llds(norm, dp, micro):
    """Σ over ranks (FSDP averages: ÷ dp) and micro-batches of the llds loss minus verl's vanilla loss equals
    λ·L_LLDS of the whole mini-batch, for every split: the effective λ does not depend on the micro-batch size."""
    data, new = mini_batch(ADV, seed=3)
    lam = 0.3
    llds_losses, _ = run_mini_batch(data, new, actor_config(llds_lambda=lam, llds_norm=norm), dp=dp, micro=micro)
    vanilla_cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                              use_dynamic_bsz=False)
    vanilla, _ = run_mini_batch(data, new, vanilla_cfg, dp=dp, micro=micro)
    term = sum(float(a) - float(v) for ra, rv in zip(llds_losses, vanilla, strict=True)
               for a, v in zip(ra, rv, strict=True)) / dp
    mask = data["response_mask"].bool()
    adv = torch.tensor(ADV)
    cfg = lld.LLDSConfig(lam=lam, norm=norm)
    # the global value: verl's denominator (batch_num_tokens / global_batch_size = every response)
    whole, st = lld.llds_loss(new, data["old_log_probs"], adv, mask, cfg, normalizer=len(ADV) if norm == "seq_mean"
                              else None)
    assert st["n_penalized_tokens"] > 0
    assert term == pytest.approx(lam * float(whole), rel=1e-5)


def test_response_norm_is_refused_with_what_to_use():
    data, new = mini_batch(ADV)
    with pytest.raises(ValueError, match="token_mean"):
        run_mini_batch(data, new, actor_config(llds_norm="response"), dp=1, micro=2)


def test_noise_floor_gates_llds_on_an_on_policy_micro_batch(caplog):
    """old_log_prob and log_prob from the same parameters (Δ = recomputation noise, here 1e-7): no LLDS term and
    no LLDS gradient, a metric and a warning; a real displacement still gets the term."""
    data, new = mini_batch([1.0, 0.5, 0.0, 1.0], seed=5, noise=1e-7)
    new = new.requires_grad_(True)
    cfg = actor_config(llds_lambda=0.5)
    verl_loss._warned_noise = False
    with caplog.at_level(logging.WARNING, logger="lld_monitor.integrations.trainers.verl_loss"):
        losses, agg = run_mini_batch(data, new, cfg, dp=1, micro=4)
    assert agg["lld/llds_noise_gated"] == 1.0 and agg["lld/llds_loss"] == 0.0
    assert 0 < agg["lld/delta_abs_max"] <= lld.NOISE_FLOOR
    assert any("noise" in r.getMessage() for r in caplog.records)
    vanilla_cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                              use_dynamic_bsz=False)
    vanilla, _ = run_mini_batch(data, new, vanilla_cfg, dp=1, micro=4)
    assert losses[0][0].item() == vanilla[0][0].item()
    # the same batch with a real displacement: the term is back
    data2, new2 = mini_batch([1.0, 0.5, 0.0, 1.0], seed=5, noise=0.3)
    _, agg2 = run_mini_batch(data2, new2, cfg, dp=1, micro=4)
    assert agg2["lld/llds_noise_gated"] == 0.0 and agg2["lld/llds_loss"] > 0
    # llds_noise_floor=0 turns the gate off
    _, agg3 = run_mini_batch(data, new, actor_config(llds_lambda=0.5, llds_noise_floor=0.0), dp=1, micro=4)
    assert agg3["lld/llds_noise_gated"] == 0.0


def test_loss_module_imports_no_store_on_workers():
    """verl loads the loss module on every worker: it must not pull the store (DuckDB, Arrow, pandas)."""
    import subprocess
    import sys

    code = ("import sys, verl.trainer.ppo.core_algos, verl.workers.config; before = set(sys.modules); "
            "import lld_monitor.integrations.trainers.verl_loss; new = set(sys.modules) - before; "
            "bad = sorted(m for m in new if m.split('.')[0] in ('duckdb', 'pyarrow', 'pandas', 'streamlit') "
            "or m.startswith('lld_monitor.store')); print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
