"""Backend training: a short real GRPO run writes a readable run with every table filled; 2-rank torchrun."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = {
    "world": {"n_people": 200, "n_orgs": 40, "n_cities": 40, "n_countries": 10, "n_first_names": 20, "n_last_names": 20},
    "model": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64},
    "sft": {"steps": 40, "n_demos": 200, "batch_size": 16},
    "grpo": {"prompts_per_step": 4, "group_size": 3, "num_minibatches": 2, "entropy_coef": 0.05},
    "env": {"max_response_tokens": 60},
    "log": {"token_groups": 2},
}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def tiny_config(tmp_path, monkeypatch):
    monkeypatch.setenv("LLD_MONITOR_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "tiny.json"
    p.write_text(json.dumps(TINY))
    return p


def _env(tmp_path):
    env = dict(os.environ)
    env["LLD_MONITOR_CACHE"] = str(tmp_path / "cache")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["vanilla", "llds-ma"])
def test_short_training_run_fills_every_table(tmp_path, tiny_config, mode):
    from lld_monitor.cli import main
    from lld_monitor.store import open_store_reader

    store = tmp_path / "store"
    rc = main(["train", "--mode", mode, "--steps", "3", "--seed", "1", "--store", str(store), "--run-name", f"t-{mode}",
               "--config", str(tiny_config), "--no-progress"])
    assert rc == 0
    r = open_store_reader(store)
    runs = r.runs()
    assert len(runs) == 1 and runs.status[0] == "finished" and int(runs.steps[0]) == 3
    rid = runs.run_id[0]
    assert runs["mode"][0] == mode.replace("-", "_")
    steps = r.steps(rid)
    assert list(steps.step) == [0, 1, 2]
    for col in ("reward_mean", "entropy", "grad_norm", "clip_frac", "pg_loss", "response_length", "lr", "step_time",
                "delta_preserved", "frac_responses_displaced", "searches_per_response"):
        assert steps[col].notna().all(), col
    met = r.metrics(rid)
    keys = set(met.key)
    for k in ("actor/pos_avg_old_log_prob", "actor/neg_avg_old_log_prob", "actor/entropy_loss", "actor/grad_norm",
              "actor/ppo_kl", "actor/pg_clipfrac", "critic/score/mean", "env/number_of_valid_search",
              "actor/mean_reduce_chunk"):
        assert k in keys, k
    s = r.samples(rid)
    assert len(s) == 3 * 4 * 3
    assert set(s.columns) >= {"reward", "advantage", "delta_sum", "text", "question", "gold"}
    # Δ is measured on the step's own tokens: new − old sums agree with the per-sample delta
    assert ((s.logp_new_sum - s.logp_old_sum) - s.delta_sum).abs().max() < 1e-3
    # π_before != π_after within a step (several mini-batch updates)
    assert (s.delta_sum.abs() > 0).any()
    tok = r.tokens(rid, 0)
    assert len(tok) > 0 and set(tok.role) <= {"action", "tool", "answer"}
    tool = tok[tok.role == "tool"]
    assert tool.logp_old.isna().all() and tool.logp_new.isna().all()  # tool tokens carry no likelihood
    act = tok[tok.role != "tool"]
    assert act.logp_old.notna().all() and (act.logp_old <= 0).all()
    assert r.token_steps(rid) == [0, 1, 2]
    # token texts read as in the response (words separated), so the token inspector can lay them side by side
    first = tok[tok.sample_idx == tok.sample_idx.iloc[0]].sort_values("position")
    assert first.token_text.str.startswith(" ").all()
    assert "".join(first.token_text).strip() == " ".join(t.strip() for t in first.token_text)
    # token logging is sampled to 2 groups of 3
    assert tok.sample_idx.nunique() <= 6
    r.close()


@pytest.mark.slow
def test_training_is_reproducible(tmp_path, tiny_config):
    from lld_monitor.cli import main
    from lld_monitor.store import open_store_reader

    out = []
    for i in range(2):
        store = tmp_path / f"s{i}"
        assert main(["train", "--mode", "llds", "--steps", "2", "--seed", "3", "--store", str(store),
                     "--config", str(tiny_config), "--no-progress"]) == 0
        r = open_store_reader(store)
        rid = r.runs().run_id[0]
        out.append(r.samples(rid)[["reward", "logp_old_sum", "logp_new_sum", "text"]])
        r.close()
    assert out[0].equals(out[1])


@pytest.mark.slow
def test_lr_warmup_and_seq_mean_loss_are_used(tmp_path, tiny_config):
    """grpo.warmup_steps ramps the logged lr linearly (verl's schedule); loss_agg trains end to end."""
    from lld_monitor.cli import main
    from lld_monitor.store import open_store_reader

    cfg = json.loads(tiny_config.read_text())
    cfg["grpo"].update({"lr": 0.001, "warmup_steps": 4, "loss_agg": "seq_mean_token_mean"})
    p = tmp_path / "warm.json"
    p.write_text(json.dumps(cfg))
    store = tmp_path / "store"
    assert main(["train", "--steps", "5", "--seed", "2", "--store", str(store), "--config", str(p), "--no-progress"]) == 0
    r = open_store_reader(store)
    steps = r.steps(r.runs().run_id[0]).sort_values("step")
    assert steps["lr"].tolist() == pytest.approx([0.00025, 0.0005, 0.00075, 0.001, 0.001])
    r.close()


@pytest.mark.slow
def test_embed_lr_scale_freezes_or_slows_the_token_embedding(tmp_path, tiny_config):
    """grpo.embed_lr_scale 0 leaves the (tied) embedding as the warm start left it while the rest trains;
    another value gives the embedding its own optimizer group at that multiple of the lr."""
    import torch

    from lld_monitor.backend.config import load_config
    from lld_monitor.backend.grpo import Trainer

    cfg = json.loads(tiny_config.read_text())
    cfg["grpo"]["embed_lr_scale"] = 0.0
    p = tmp_path / "frozen.json"
    p.write_text(json.dumps(cfg))
    tr = Trainer(load_config(p, steps=1, seed=1), str(tmp_path / "store"), "frozen", progress=False)
    emb0 = tr.model.get_input_embeddings().weight.detach().clone()
    rest0 = [q.detach().clone() for q in tr.model.parameters() if q.requires_grad]
    tr.train()
    assert torch.equal(tr.model.get_input_embeddings().weight, emb0)
    assert tr.model.get_output_embeddings().weight is tr.model.get_input_embeddings().weight
    moved = [not torch.equal(a, b) for a, b in zip(rest0, [q for q in tr.model.parameters() if q.requires_grad])]
    assert any(moved)

    cfg["grpo"].update({"embed_lr_scale": 0.5, "lr": 0.001})
    p.write_text(json.dumps(cfg))
    tr = Trainer(load_config(p, steps=0, seed=1), str(tmp_path / "store2"), "half", progress=False)
    lrs = sorted(grp["lr"] for grp in tr.opt.param_groups)
    assert lrs == pytest.approx([0.0005, 0.001])
    assert tr.opt.param_groups[1]["params"] == [tr.model.get_input_embeddings().weight]


@pytest.mark.parametrize("bad", [{"loss_agg": "sum"}, {"warmup_steps": -1}, {"embed_lr_scale": -1},
                                 {"lr_schedule": "linear"}, {"min_lr_ratio": 1.5}])
def test_bad_grpo_settings_are_clear_errors(bad):
    from lld_monitor.backend.config import config_from_dict

    with pytest.raises(ValueError, match=next(iter(bad))):
        config_from_dict({"grpo": bad})


def test_lr_schedule_warms_up_then_holds_or_follows_a_cosine():
    from lld_monitor.backend.adamw import lr_at

    assert [lr_at(s, 4) for s in (0, 1, 3, 4, 100)] == [0.25, 0.5, 1.0, 1.0, 1.0]  # verl's constant schedule
    assert lr_at(7, 0) == 1.0
    cos = [lr_at(s, 4, "cosine", 14, 0.1) for s in range(14)]
    assert cos[:4] == [0.25, 0.5, 0.75, 1.0]  # the same warm-up
    assert cos[4] == 1.0 and cos[9] == pytest.approx(0.55) and cos[13] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert all(a >= b for a, b in zip(cos[4:], cos[5:]))  # then only down


def test_config_loss_aggs_are_lld_s():
    from lld_monitor import lld
    from lld_monitor.backend import config

    assert config.LOSS_AGGS == lld.LOSS_AGGS


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    from lld_monitor.cli import main

    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"grpo": {"learning_rate": 1}}))
    assert main(["train", "--config", str(p), "--store", str(tmp_path / "s")]) == 2
    assert "unknown config key" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_two_ranks_write_one_run(tmp_path, tiny_config):
    from lld_monitor.store import open_store_reader

    store = tmp_path / "store"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", "29517", "-m", "lld_monitor.cli", "train",
           "--mode", "llds", "--steps", "2", "--store", str(store), "--run-name", "ddp", "--config", str(tiny_config),
           "--no-progress", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = open_store_reader(store)
    runs = r.runs()
    assert len(runs) == 1, runs
    rid = runs.run_id[0]
    assert int(runs.world_size[0]) == 2 and runs.status[0] == "finished"
    s = r.samples(rid)
    assert sorted(s["rank"].unique().tolist()) == [0, 1]
    assert len(s) == 2 * 4 * 3  # both ranks' rollouts of both steps
    steps = r.steps(rid)
    assert list(steps.step) == [0, 1]
    assert (steps.n_samples == 12).all()  # the step row aggregates both ranks' samples
    # the step's reward is the mean over all ranks' samples
    for st, grp in s.groupby("step"):
        assert math.isclose(float(steps.set_index("step").reward_mean[st]), float(grp.reward.mean()), abs_tol=1e-9)
    r.close()


def test_warmstart_cache_key_covers_what_changes_the_checkpoint():
    from dataclasses import replace

    from lld_monitor.backend.config import TrainConfig
    from lld_monitor.backend.sft import cache_key

    c = TrainConfig()
    k = cache_key(c.world, c.model, c.sft, c.env)
    assert k == cache_key(c.world, c.model, c.sft, c.env)
    assert k == cache_key(c.world, c.model, c.sft, replace(c.env, temperature=0.7))  # rollout-only knob
    for other in (
        cache_key(replace(c.world, seed=1), c.model, c.sft, c.env),
        cache_key(c.world, replace(c.model, hidden_size=64), c.sft, c.env),
        cache_key(c.world, c.model, replace(c.sft, steps=10), c.env),
        cache_key(c.world, c.model, c.sft, replace(c.env, topk=3)),
        cache_key(replace(c.world, unique_names=True), c.model, c.sft, c.env),
    ):
        assert other != k
    # a field added after the first checkpoints is keyed only when set, so the shipped keys did not move
    # (test_warmstart_is_shipped finds them)


@pytest.mark.parametrize("config", [None, ROOT / "scripts" / "spiral_config.json", ROOT / "bench" / "step_speed_config.json"],
                         ids=["default", "spiral", "bench"])
def test_warmstart_is_shipped(config):
    """The default config's warm start ships, and so do scripts/spiral_config.json's (the demo and
    scripts/make_sample_runs.py train it) and bench/backend_step.py's, so they all start training at once."""
    from lld_monitor.backend.config import load_config
    from lld_monitor.backend.sft import ASSETS, cache_key

    c = load_config(config)
    assert (ASSETS / cache_key(c.world, c.model, c.sft, c.env) / "model.safetensors").is_file()


@pytest.mark.slow
def test_ctrl_c_leaves_a_finished_readable_run(tmp_path, tiny_config):
    import signal
    import time

    from lld_monitor.store import open_store_reader

    store = tmp_path / "store"
    # far more steps than the test waits for: a run that ends before SIGINT is handled tests nothing
    cmd = [sys.executable, "-m", "lld_monitor.cli", "train", "--steps", "100000", "--store", str(store), "--run-name", "sigint",
           "--run-id", "sigint-run", "--config", str(tiny_config), "--no-progress"]
    # a shell without job control starts background jobs with SIGINT ignored, and children inherit that
    # (CI may run us so): give the trainer the default disposition, as in a terminal
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        seen = 0
        while time.time() < deadline and seen < 3:
            time.sleep(0.5)
            if (store / "store.json").exists():
                try:
                    r = open_store_reader(store)
                    seen = len(r.steps("sigint-run")) if len(r.runs()) else 0
                    r.close()
                except Exception:  # noqa: BLE001 - the run may not be visible yet
                    seen = 0
        assert seen >= 3, "training did not start in time"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    r = open_store_reader(store)
    run = r.runs().iloc[0]
    assert run.status == "finished"
    assert 3 <= int(run.steps) < 100000
    assert len(r.samples("sigint-run")) == int(run.steps) * 12
    r.close()


@pytest.mark.slow
def test_model_path_trains_a_local_hf_model(tmp_path, tiny_config):
    from lld_monitor.backend.config import load_config
    from lld_monitor.backend.sft import warmstart
    from lld_monitor.cli import main
    from lld_monitor.store import open_store_reader

    cfg = load_config(tiny_config)
    _, _, ckpt = warmstart(cfg.world, cfg.model, cfg.sft, cfg.env)  # a plain HF model directory
    store = tmp_path / "store"
    assert main(["train", "--model", str(ckpt), "--steps", "1", "--store", str(store), "--config", str(tiny_config),
                 "--no-progress"]) == 0
    r = open_store_reader(store)
    assert r.runs().model[0] == str(ckpt)
    assert len(r.samples(r.runs().run_id[0])) == 12
    r.close()
    assert main(["train", "--model", str(tmp_path / "nope"), "--steps", "1", "--store", str(store)]) == 2


@pytest.mark.slow
def test_warmstart_launched_twice_at_once_is_trained_once(tmp_path, tiny_config):
    """Two trainers started together on a new setting: one trains the checkpoint, the other waits and
    loads it (an flock next to the cache), so both get the same files and only one 'training' line."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
        "from lld_monitor.backend.config import load_config; from lld_monitor.backend.sft import warmstart;"
        f"c = load_config({str(tiny_config)!r}); print('CKPT', warmstart(c.world, c.model, c.sft, c.env)[2])"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(o.count("training one (once)") for o in outs) == 1, outs
    ckpts = {line.split()[-1] for o in outs for line in o.splitlines() if line.startswith("CKPT")}
    assert len(ckpts) == 1 and (Path(ckpts.pop()) / "model.safetensors").is_file()
    assert not [d for d in (tmp_path / "cache" / "warmstart").iterdir() if d.is_dir() and d.name.startswith(".")]
