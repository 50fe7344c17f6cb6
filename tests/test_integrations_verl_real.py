"""verl integration against the real verl package (0.9.1, CPU tensors of verl's shapes): the registered `llds`
policy loss, `lld_metrics` on what verl really has, and the driver hook's token rows. A real verl run needs
Ray and GPUs and is not run here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl", reason="verl is an optional extra: pip install 'lld-monitor[verl]' (see docs/integrations.md)")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from lld_monitor import lld  # noqa: E402
from lld_monitor.integrations.trainers import verl_loss  # noqa: E402,F401  (registers "llds")
from lld_monitor.integrations.trainers.verl_metrics import lld_metrics  # noqa: E402

B, P, R = 8, 6, 12  # 2 prompts x 4 rollouts, prompt length 6, response length 12


def verl_batch(seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(5, 100, (B, R), generator=g)
    attn_resp = torch.zeros(B, R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        length = 8 + i % 4
        attn_resp[i, :length] = 1
        response_mask[i, :length] = 1
        if i % 2:
            response_mask[i, 3:5] = 0  # a tool result (observation) block: attended, not trained on
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    grouped = scores.view(2, 4)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
    old = -torch.rand(B, R, generator=g) * 3
    tls = torch.zeros(B, R)
    tls[torch.arange(B), attn_resp.sum(1) - 1] = scores
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.randint(5, 100, (B, P), generator=g),
            "responses": responses,
            "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), attn_resp], 1),
            "response_mask": response_mask,
            "old_log_probs": old,
            "advantages": adv.unsqueeze(1) * attn_resp,
            "token_level_scores": tls,
        },
        non_tensors={"uid": np.array(["p0"] * 4 + ["p1"] * 4, dtype=object)},
        meta_info={"valid_search_stats": [1, 0, 2, 1, 0, 0, 1, 1]},
    )
    return data


def actor_config(**policy_loss) -> ActorConfig:
    cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1)
    if policy_loss:
        cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                          policy_loss=verl_loss.LLDSPolicyLossConfig(loss_mode="llds", **policy_loss))
    return cfg


@pytest.mark.parametrize("kw", [{}, {"llds_lambda": 0.5, "llds_norm": "seq_mean", "llds_gate": "response"}])
def test_registered_loss_is_vanilla_plus_our_llds(kw):
    assert "llds" in POLICY_LOSS_REGISTRY
    data = verl_batch()
    old, mask, adv = data.batch["old_log_probs"], data.batch["response_mask"].bool(), data.batch["advantages"]
    g = torch.Generator().manual_seed(3)
    new = (old + torch.randn(B, R, generator=g) * 0.2).requires_grad_(True)
    config = actor_config(**kw)
    loss_fn = get_policy_loss_fn("llds")
    loss, metrics = loss_fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                            loss_agg_mode="token-mean", config=config, rollout_is_weights=None)
    vanilla, _ = get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                               loss_agg_mode="token-mean", config=config, rollout_is_weights=None)
    cfg = lld.LLDSConfig(lam=kw.get("llds_lambda", 0.2), gate=kw.get("llds_gate", "action"),
                         norm=kw.get("llds_norm", "token_mean"))  # verl's default norm: token_mean
    term, st = lld.llds_loss(new, old, adv, mask, cfg)
    assert float(term) > 1e-3 and st["n_penalized_tokens"] > 0
    assert float(loss) == pytest.approx(float(vanilla) + cfg.lam * float(term), rel=1e-6)
    loss.backward()
    assert new.grad is not None and torch.isfinite(new.grad).all()
    # verl's own metrics plus ours, per micro-batch (verl averages them over micro-batches)
    assert "actor/pg_clipfrac" in metrics
    assert metrics["lld/llds_loss"] == pytest.approx(cfg.lam * float(term), rel=1e-6)
    assert set(verl_loss.METRIC_KEYS) <= set(metrics) and metrics["lld/llds_noise_gated"] == 0.0


def test_lld_metrics_takes_what_verl_has():
    """Micro-batch log-prob passed in, no response/loss mask (attention-mask slice), searches in meta_info."""
    data = verl_batch()
    new = data.batch["old_log_probs"] - 0.1
    data.batch.pop("response_mask")
    got = lld_metrics(data, log_prob=new, llds=lld.LLDSConfig(lam=0.2))
    assert got["lld/searches_per_response"] == pytest.approx(0.75)
    assert got["lld/delta_preserved_mean"] == pytest.approx(-0.1, abs=1e-6)
    assert got["lld/frac_responses_displaced"] == 1.0
    with pytest.raises(KeyError, match="log_prob="):
        lld_metrics(verl_batch())


def test_driver_hook_writes_tokens_with_tool_role(tmp_path, monkeypatch):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from lld_monitor.integrations.trainers.verl_hook import LLDRayPPOTrainer
    from lld_monitor.logger import RunLogger
    from lld_monitor.store import open_store_reader

    data = verl_batch()
    after = data.batch["old_log_probs"] - 0.05  # post-update: every model token fell a little
    calls: list[str] = []

    def fake_update(self, batch):
        calls.append("update")
        return DataProto.from_single_dict(data={}, meta_info={"metrics": {}})

    def fake_old_log_prob(self, batch):
        calls.append("compute_log_prob")
        return DataProto.from_dict(tensors={"old_log_probs": after}), 0.0

    monkeypatch.setattr(RayPPOTrainer, "_update_actor", fake_update)
    monkeypatch.setattr(RayPPOTrainer, "_compute_old_log_prob", fake_old_log_prob)
    trainer = LLDRayPPOTrainer.__new__(LLDRayPPOTrainer)  # no Ray workers: only the override is exercised
    trainer.config = {"trainer": {"experiment_name": "verl-hook"}}
    trainer.global_steps = 7
    trainer.lld_bypass = False
    trainer.lld_logger = RunLogger(str(tmp_path / "s"), "verl-hook", "vanilla", {}, source="verl")
    out = trainer._update_actor(data)
    assert calls == ["update", "compute_log_prob"] and "metrics" in out.meta_info
    # the extra pass has its own timing key among the actor metrics verl logs (it runs inside update_actor's timer)
    from lld_monitor.integrations.trainers.verl_hook import SHARE_KEY, TIMING_KEY

    assert out.meta_info["metrics"][TIMING_KEY] >= 0 and SHARE_KEY in out.meta_info["metrics"]
    trainer.lld_logger.close()
    with open_store_reader(tmp_path / "s") as r:
        run = r.runs().iloc[0]
        assert run["source"] == "verl"
        tok = r.tokens(run["run_id"], 7)
        mask = data.batch["response_mask"].bool()
        attn = data.batch["attention_mask"][:, -R:].bool()
        assert len(tok) == int(attn.sum())
        assert (tok["role"] == "tool").sum() == int((attn & ~mask).sum()) == 8  # 4 rows x 2 tool tokens
        act = tok[tok["role"] == "action"]
        assert np.allclose(act["logp_new"] - act["logp_old"], -0.05, atol=1e-6)
        sm = r.samples(run["run_id"], step=7).sort_values("sample_idx")
        assert sm["n_searches"].tolist() == [0, 1] * 4
        assert sm["group_id"].tolist() == ["p0"] * 4 + ["p1"] * 4
        assert np.allclose(sm["delta_sum"], -0.05 * mask.sum(1).numpy(), atol=1e-5)  # tool tokens excluded
        st = r.steps(run["run_id"]).set_index("step")
        assert st.loc[7, "frac_responses_displaced"] == 1.0


def test_on_policy_share_from_the_config():
    """1 / (ppo_epochs x mini-batches per step): the share of actor updates whose Δ is recomputation noise."""
    from lld_monitor.integrations.trainers.verl_hook import on_policy_share

    def cfg(train, mini, epochs):
        return {"data": {"train_batch_size": train},
                "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini, "ppo_epochs": epochs}}}

    assert on_policy_share(cfg(256, 256, 1)) == 1.0
    assert on_policy_share(cfg(256, 64, 1)) == 0.25
    assert on_policy_share(cfg(256, 128, 2)) == 0.25
