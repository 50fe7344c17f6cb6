"""Synthetic run stores for dashboard tests and benchmarks, written through the real RunWriter.

The dynamics imitate the paper's three phases for a vanilla run (log-likelihood of correct responses flat,
then decaying; entropy creeping then surging; grad-norm spike; reward collapsing last) and a stable
LLDS twin with the same config. Per-sample and per-token rows are consistent: a sample's delta_sum is
the sum of its action/answer tokens' logp_new − logp_old; tool tokens carry NULL log-probs.

    python bench/synth_store.py /tmp/store --steps 200          # a vanilla + LLDS pair
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lld_monitor.store import RunWriter  # noqa: E402

log = logging.getLogger(__name__)

VOCAB = np.array(
    ["<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>",
     " the", " who", " wrote", " capital", " of", " France", " Paris", " is", " a", " city", " river", " born",
     " in", " 1879", " Einstein", " physicist", " novel", " author", " Tolstoy", " war", " and", " peace",
     "\n", " Doc", " 1", ":", " <b>", "</b>", " & ", " 'quote'"],
    dtype=object,
)
ANSWER_WORDS = np.array([13, 14, 22, 26, 21], dtype=np.int32)


@dataclass
class SynthConfig:
    name: str = "synth-vanilla"
    mode: str = "vanilla"  # vanilla collapses; llds / llds_ma stay stable
    source: str = "local"
    samples: bool = True  # per-sample rows (False: step signals only, like a W&B import)
    steps: int = 200
    groups: int = 4
    group_size: int = 5
    token_every: int = 1  # token rows every k steps (0 = none, like an imported run)
    action_tokens: tuple[int, int] = (40, 30)  # tokens of action 0 (think + search) and action 1 (think + answer)
    tool_tokens: int = 60
    flush_every: int = 20
    finish: bool = True
    seed: int = 0
    config: dict = field(default_factory=lambda: {"lr": 1e-5, "group_size": 5, "model": "tiny", "seed": 0})
    write_alerts: bool = True  # run the online detector as RunLogger does: its alerts and state checkpoints stored
    checkpoint_every: int = 500  # detector checkpoints every k steps (0 = none, like a run of an older version)
    step_sleep: float = 0.0  # seconds between steps (a live writer for tests)


def _curves(cfg: SynthConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n = cfg.steps
    s = np.arange(n, dtype=np.float64)
    x = s / max(n - 1, 1)
    noise = lambda sc: rng.normal(0.0, sc, n)  # noqa: E731
    if cfg.mode == "vanilla":
        onset, turn, collapse = 0.3, 0.6, 0.75
        decay = np.clip((x - onset) / (turn - onset), 0, 1)
        accel = np.clip((x - turn) / (1 - turn), 0, 1)
        reward = 0.15 + 0.35 * np.clip(x / turn, 0, 1) - 0.5 * np.clip((x - collapse) / (1 - collapse), 0, 1) ** 0.7
        ll_c = -0.25 - 0.25 * decay - 2.5 * accel**2
        delta = -0.002 - 0.02 * decay - 0.15 * accel
        frac = 0.3 + 0.15 * decay + 0.4 * accel
        ent = 0.9 + 0.2 * x + 2.0 * accel**2
        grad = 0.5 + 0.1 * x + 6.0 * np.exp(-(((x - turn - 0.05) / 0.03) ** 2)) + 3 * accel**2
    else:
        reward = 0.15 + 0.4 * (1 - np.exp(-4 * x))
        ll_c = -0.25 + 0.05 * x
        delta = 0.001 + 0.0 * x
        frac = 0.28 + 0.02 * x
        ent = 0.9 + 0.1 * x
        grad = 0.5 + 0.05 * x
    reward = np.clip(reward + noise(0.03), 0, 1)
    return {
        "reward_mean": reward,
        "accuracy": np.clip(reward + noise(0.01), 0, 1),
        "ll_correct_mean": ll_c + noise(0.01),
        "ll_incorrect_mean": ll_c - 0.3 + noise(0.01),
        "delta_preserved_mean": delta + noise(0.002),
        "frac_actions_displaced": np.clip(frac + noise(0.02), 0, 1),
        "entropy": ent + noise(0.02),
        "grad_norm": np.abs(grad + noise(0.05)),
    }


def _step_rows(cfg: SynthConfig, curves: dict[str, np.ndarray], i: int, rng: np.random.Generator):
    n = cfg.groups * cfg.group_size
    p = float(curves["reward_mean"][i])
    reward = (rng.random(n) < p).astype(np.float64)
    groups = np.repeat(np.arange(cfg.groups), cfg.group_size)
    adv = np.zeros(n)
    for g in range(cfg.groups):
        m = groups == g
        sd = reward[m].std(ddof=1)
        adv[m] = (reward[m] - reward[m].mean()) / (sd + 1e-6) if sd > 0 else 0.0
    a0, a1 = cfg.action_tokens
    t_len = a0 + cfg.tool_tokens + a1
    with_tokens = cfg.token_every > 0 and i % cfg.token_every == 0
    # per-token log-probs (computed for every step: the sample sums must be exact either way)
    scored = a0 + a1
    mean_delta = float(curves["delta_preserved_mean"][i])
    logp_old = -np.abs(rng.normal(0.3, 0.5, (n, scored))).astype(np.float32)
    d = rng.normal(mean_delta, 0.03 + abs(mean_delta), (n, scored)).astype(np.float32)
    logp_new = np.minimum(logp_old + d, 0).astype(np.float32)
    delta = (logp_new.astype(np.float64) - logp_old.astype(np.float64))
    act0 = delta[:, :a0].sum(1)
    act1 = delta[:, a0:].sum(1)
    samples = {
        "step": np.full(n, i, dtype=np.int64), "rank": np.zeros(n, dtype=np.int32), "sample_idx": np.arange(n, dtype=np.int32),
        "prompt_id": [f"q{i}-{g}" for g in groups], "group_id": [f"{i}-{g}" for g in groups],
        "reward": reward, "advantage": adv, "correct": reward > 0,
        "n_actions": np.full(n, 2, dtype=np.int32), "n_searches": np.ones(n, dtype=np.int32),
        "n_action_tokens": np.full(n, scored, dtype=np.int32),
        "logp_old_sum": logp_old.sum(1, dtype=np.float64), "logp_new_sum": logp_new.sum(1, dtype=np.float64),
        "delta_sum": delta.sum(1), "delta_mean": delta.mean(1),
        "n_actions_displaced": ((act0 < 0).astype(np.int32) + (act1 < 0).astype(np.int32)),
        "question": [f"Who wrote 'War & Peace'? (q{i}-{g})" for g in groups],
        "gold": ["Tolstoy"] * n, "text": ["<search>who wrote war and peace</search> ... <answer>Tolstoy</answer>"] * n,
    }
    tokens = None
    if with_tokens:
        role = np.empty(t_len, dtype=object)
        role[:a0] = "action"
        role[a0:a0 + cfg.tool_tokens] = "tool"
        role[a0 + cfg.tool_tokens:] = "action"
        role[-4:] = "answer"  # <answer> word word </answer>
        action_idx = np.concatenate([np.zeros(a0), -np.ones(cfg.tool_tokens), np.ones(a1)]).astype(np.int32)
        ids = rng.integers(8, len(VOCAB), (n, t_len)).astype(np.int32)
        ids[:, a0 - 1] = 3
        ids[:, 0] = 2
        ids[:, a0] = 4
        ids[:, a0 + cfg.tool_tokens - 1] = 5
        ids[:, -4] = 6
        ids[:, -3:-1] = ANSWER_WORDS[rng.integers(0, len(ANSWER_WORDS), (n, 2))]
        ids[:, -1] = 7
        lo = np.full((n, t_len), np.nan, dtype=np.float32)
        ln = np.full((n, t_len), np.nan, dtype=np.float32)
        mask = action_idx >= 0
        lo[:, mask] = logp_old
        ln[:, mask] = logp_new
        ref = lo - np.float32(0.01)
        ent = np.where(mask, rng.gamma(2.0, float(curves["entropy"][i]) / 2, (n, t_len)), np.nan).astype(np.float32)
        flat_ids = ids.ravel()
        tokens = pa.table({
            "step": pa.array(np.full(n * t_len, i, dtype=np.int64)),
            "rank": pa.array(np.zeros(n * t_len, dtype=np.int32)),
            "sample_idx": pa.array(np.repeat(np.arange(n, dtype=np.int32), t_len)),
            "position": pa.array(np.tile(np.arange(t_len, dtype=np.int32), n)),
            "token_id": pa.array(flat_ids),
            "token_text": pa.array(VOCAB.tolist(), type=pa.string()).take(pa.array(flat_ids)),
            "role": pa.array(np.tile(role, n).tolist(), type=pa.string()),
            "action_idx": pa.array(np.tile(action_idx, n)),
            "logp_old": pa.array(lo.ravel(), mask=np.isnan(lo.ravel())),
            "logp_new": pa.array(ln.ravel(), mask=np.isnan(ln.ravel())),
            "logp_ref": pa.array(ref.ravel(), mask=np.isnan(ref.ravel())),
            "entropy": pa.array(ent.ravel(), mask=np.isnan(ent.ravel())),
        })
    return samples, tokens


def write_run(store: str | Path, cfg: SynthConfig, progress: bool = False) -> str:
    """Write one synthetic run into `store` (created if needed); returns its run_id."""
    rng = np.random.default_rng(cfg.seed)
    curves = _curves(cfg, rng)
    config = dict(cfg.config)
    config["mode"] = cfg.mode
    if cfg.mode != "vanilla":
        config["llds"] = {"lam": 0.2, "gate": "action", "answer_weight": 0.5 if cfg.mode == "llds_ma" else None}
    w = RunWriter.create(str(store), cfg.name, cfg.mode, source=cfg.source, config=config, model="synthetic")
    # step times: wall clock for a live writer, else one second apart ending now
    now = np.datetime64(datetime.now(timezone.utc).replace(tzinfo=None), "us")
    start = now - np.timedelta64(cfg.steps * 1_000_000, "us")
    recorder = _recorder(cfg) if cfg.write_alerts else None
    it = range(cfg.steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"writing {cfg.name}", unit="step")
    for i in it:
        samples, tokens = _step_rows(cfg, curves, i, rng)
        t = (np.datetime64(datetime.now(timezone.utc).replace(tzinfo=None), "us") if cfg.step_sleep
             else start + np.timedelta64(i * 1_000_000, "us"))
        row = {"step": [i], "time": [t], "n_samples": [len(samples["reward"])]}
        row.update({k: [float(v[i])] for k, v in curves.items()})
        row["reward_std"] = [float(np.std(samples["reward"]))]
        row["delta_preserved"] = [float(np.mean(samples["delta_sum"][samples["advantage"] >= 0]))
                                  if (samples["advantage"] >= 0).any() else None]
        w.append("steps", row)
        metrics = {"custom/loss_scale": 1.0, "timing/gen": 0.1 + 0.01 * i}
        w.append("metrics", {"step": [i, i], "key": list(metrics), "value": list(metrics.values())})
        if recorder is not None:  # what RunLogger's writer thread does with the step row and the metrics
            signals = {k: v[0] for k, v in row.items() if k not in ("step", "time", "n_samples") and v[0] is not None}
            _detect_step(w, recorder, i, {**signals, **metrics}, cfg.checkpoint_every)
        if cfg.samples:
            w.append("samples", samples)
        if tokens is not None and cfg.samples:
            w.append("tokens", tokens)
        if (i + 1) % cfg.flush_every == 0:
            w.flush()
        if cfg.step_sleep:
            time.sleep(cfg.step_sleep)
    if recorder is not None and recorder.pending and cfg.checkpoint_every:
        w.append("detector_state", recorder.checkpoint())
    if cfg.finish:
        w.finish()
    else:
        w.flush()
    return w.run_id


def _recorder(cfg: SynthConfig):
    try:
        from lld_monitor.detect import OnlineDetector
        from lld_monitor.detect.checkpoint import CheckpointRecorder
    except ImportError:
        log.info("detector not available: no alerts stored")
        return None
    return CheckpointRecorder(OnlineDetector(), every=max(1, cfg.checkpoint_every))


def _detect_step(w: RunWriter, recorder, step: int, signals: dict, checkpoint_every: int) -> None:
    alerts = recorder.update(step, signals)
    if alerts:
        rows = [a.to_dict() for a in alerts]
        w.append("alerts", {k: [r[k] for r in rows] for k in rows[0]})
    if checkpoint_every and recorder.due:
        w.append("detector_state", recorder.checkpoint())


def write_pair(store: str | Path, steps: int = 200, **kw) -> tuple[str, str]:
    """A vanilla run and its LLDS twin (same config apart from mode/regularizer); returns their run_ids."""
    v = write_run(store, SynthConfig(name="synth-vanilla", mode="vanilla", steps=steps, seed=1, **kw))
    t = write_run(store, SynthConfig(name="synth-llds", mode="llds", steps=steps, seed=2, **kw))
    return v, t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--token-every", type=int, default=1)
    ap.add_argument("--single", choices=("vanilla", "llds", "llds_ma"), default=None,
                    help="write one run of this mode instead of a pair")
    ap.add_argument("--name", default=None)
    ap.add_argument("--flush-every", type=int, default=20)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds between steps (a live writer)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if a.single:
        cfg = SynthConfig(name=a.name or f"synth-{a.single}", mode=a.single, steps=a.steps, token_every=a.token_every,
                          flush_every=a.flush_every, step_sleep=a.step_sleep, write_alerts=False)
        print(write_run(a.store, cfg))
    else:
        print(write_pair(a.store, steps=a.steps, token_every=a.token_every, flush_every=a.flush_every))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
