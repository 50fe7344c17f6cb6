"""Synthetic step-signal trajectories with known phase boundaries, for tests and for tuning the
detector before real runs exist. They follow the order of events of the LLD paper (arXiv 2512.04220) §2:
likelihood flat (I), then declining while reward still rises (II), then entropy / grad-norm surge and
accelerating likelihood drop (III), then the reward collapses. Numpy only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

VERL_NAMES = {
    "reward_mean": "critic/score/mean",
    "entropy": "actor/entropy_loss",
    "grad_norm": "actor/grad_norm",
    "clip_frac": "actor/pg_clipfrac",
    "kl": "actor/kl_loss",
    "ll_correct_mean": "actor/pos_avg_old_log_prob",
}


@dataclass
class SpiralSpec:
    steps: int = 300
    rise_end: int = 30  # likelihood rises until here (healthy) ...
    decay_start: int | None = 80  # ... is flat until here (phase I); None = never decays (healthy run)
    accel_start: int | None = 150  # phase III begins
    collapse_start: int | None = 180  # reward starts to fall hard
    noise: float = 1.0  # noise multiplier
    seed: int = 0
    ar_phi: float = 0.0  # AR(1) coefficient of the likelihood noise (0 = independent per step)


def ar1(n: int, phi: float, sd: float, rng: np.random.Generator) -> np.ndarray:
    """Stationary AR(1) noise with marginal standard deviation `sd`."""
    e = rng.normal(0.0, sd * np.sqrt(1.0 - phi**2), n)
    x = np.empty(n)
    x[0] = rng.normal(0.0, sd)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + e[i]
    return x


def spiral(spec: SpiralSpec | None = None) -> pd.DataFrame:
    """One synthetic run as a signals DataFrame (canonical column names)."""
    sp = spec or SpiralSpec()
    rng = np.random.default_rng(sp.seed)
    t = np.arange(sp.steps, dtype=float)
    n = sp.noise

    # correct-response log-likelihood per token
    ll = np.where(t < sp.rise_end, -0.9 + 0.4 * t / sp.rise_end, -0.5)
    if sp.decay_start is not None:
        ll = ll - np.clip(t - sp.decay_start, 0, None) * 0.0025
    if sp.accel_start is not None:
        ll = ll - np.clip(t - sp.accel_start, 0, None) ** 2 * 0.0006
    ll = ll + (ar1(t.size, sp.ar_phi, 0.02 * n, rng) if sp.ar_phi else rng.normal(0, 0.02 * n, t.size))

    # reward rises, keeps rising through phase II, falls after collapse_start
    reward = 0.1 + 0.45 / (1 + np.exp(-(t - 40) / 15))
    if sp.collapse_start is not None:
        reward = reward * np.exp(-np.clip(t - sp.collapse_start, 0, None) / 12.0)
    reward = np.clip(reward + rng.normal(0, 0.04 * n, t.size), 0, 1)

    entropy = 0.8 + 0.0005 * t
    if sp.accel_start is not None:
        entropy = entropy + np.clip(t - sp.accel_start - 5, 0, None) * 0.03
    entropy = entropy + rng.normal(0, 0.02 * n, t.size)

    grad = rng.lognormal(np.log(1.0), 0.12 * n, t.size)
    if sp.accel_start is not None:
        grad = grad * (1 + np.clip(t - sp.accel_start - 8, 0, None) * 0.15)

    delta = rng.normal(0.02, 0.03 * n, t.size)
    if sp.decay_start is not None:
        delta = delta - np.where(t >= sp.decay_start, 0.06, 0.0)
    if sp.accel_start is not None:
        delta = delta - np.clip(t - sp.accel_start, 0, None) * 0.003
    frac = np.clip(0.45 + rng.normal(0, 0.05 * n, t.size) + np.where(delta < 0, 0.1, 0.0), 0, 1)

    clip = np.clip(rng.normal(0.05, 0.01 * n, t.size), 0, 1)
    if sp.accel_start is not None:
        clip = clip + np.clip(t - sp.accel_start - 8, 0, None) * 0.004
    kl = np.clip(0.001 * t + rng.normal(0, 0.005 * n, t.size), 0, None)

    return pd.DataFrame(
        {
            "step": np.arange(sp.steps),
            "reward_mean": reward,
            "ll_correct_mean": ll,
            "delta_preserved_mean": delta,
            "frac_responses_displaced": frac,
            "entropy": entropy,
            "grad_norm": grad,
            "clip_frac": clip,
            "kl": kl,
        }
    )


def healthy(steps: int = 300, seed: int = 0, noise: float = 1.0, ar_phi: float = 0.0) -> pd.DataFrame:
    """A run that never decays or collapses (likelihood rises then plateaus, reward rises then holds)."""
    df = spiral(SpiralSpec(steps=steps, decay_start=None, accel_start=None, collapse_start=None, noise=noise,
                           seed=seed, ar_phi=ar_phi))
    # a healthy (regularized) run: preserved responses gain likelihood
    rng = np.random.default_rng(seed + 1000)
    df["delta_preserved_mean"] = rng.normal(0.02, 0.03 * noise, steps)
    return df


def to_verl(df: pd.DataFrame) -> pd.DataFrame:
    """Step-scalar-only version: token-derived columns dropped, the rest renamed to verl keys."""
    keep = {"step": "step", **VERL_NAMES}
    return df[[c for c in keep if c in df.columns]].rename(columns=keep)
