"""Training configuration: nested dataclasses with CPU-sized defaults, loadable from JSON or TOML.

Every section of the trainer's config is defined here (the world's in `world.py`), so importing this module
loads neither torch nor the store's libraries (duckdb, pyarrow, pandas).

A config file holds any subset of the sections below, e.g.::

    {"grpo": {"lr": 0.002, "num_minibatches": 8}, "llds": {"lam": 0.2}, "seed": 3}

Unknown keys are an error (a typo must not silently train something else).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from .numerics import NUMERICS
from .world import WorldConfig

MODES = ("vanilla", "llds", "llds-ma")
# lld.LOSS_AGGS, repeated so that checking a config does not import torch (a test pins the two equal)
LOSS_AGGS = ("token_mean", "seq_mean_token_mean")


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 512
    # kept for the warm-start cache key (the shipped checkpoints' keys include it); TinyLM has one attention
    attn_implementation: str = "eager"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    n_demos: int = 4000
    shortcut_frac: float = 0.35  # two-hop demos that answer after the first search (wrong)
    guess_frac: float = 0.05  # demos that answer without searching (usually wrong)
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EnvConfig:
    max_turns: int = 3  # searches allowed; one more action follows in which search is not executed
    max_action_tokens: int = 12  # per action; an action that reaches it without a close tag is invalid
    max_response_tokens: int = 200  # actions + observations
    topk: int = 2
    max_obs_words: int = 40
    temperature: float = 1.0
    top_p: float = 1.0
    prompt_template: str = "question : {question}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GRPOConfig:
    lr: float = 3e-4  # 2e-3 destroys the warm start in one step (measured); see docs/backend.md
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0  # linear lr warm-up over this many GRPO steps (verl)
    lr_schedule: str = "constant"  # after the warm-up: constant | cosine (to min_lr_ratio x lr at the last step; verl)
    min_lr_ratio: float = 0.0
    prompts_per_step: int = 8
    group_size: int = 5  # G rollouts per prompt
    num_minibatches: int = 4  # optimizer updates per step per epoch (pi_before != pi_after)
    ppo_epochs: int = 1
    clip_eps: float = 0.2
    loss_agg: str = "token_mean"  # token_mean (verl) | seq_mean_token_mean (DeepSeekMath GRPO, TRL "grpo")
    kl_coef: float = 0.0  # k3 KL to the frozen reference; 0 = no KL term (the reference is still logged)
    entropy_coef: float = 0.0  # entropy bonus (verl's entropy_coeff)
    grad_clip: float = 1.0
    # lr multiplier of the token embedding (tied to the output head); 0 freezes it. Adam moves a rare
    # token's row by about lr per coordinate whenever it gets any gradient, whatever its size.
    embed_lr_scale: float = 1.0
    log_ref: bool = True  # forward the frozen reference each step (logp_ref, KL, verl ref metrics)


@dataclass(frozen=True)
class LLDSSettings:
    lam: float = 0.2
    gate: str = "action"  # action (A-gate) | response (R-gate) | token
    norm: str = "response"  # response (paper) | token_mean (official code)
    ma_answer_weight: float | None = None  # LLDS-MA fixed beta; None -> adaptive rule below
    ma_adaptive_beta: str = "paper"  # paper: beta = min(V / v_base, 1); code: min(max(V - 1, 0), 1)
    v_base: float = 2.0


@dataclass(frozen=True)
class LogSettings:
    token_every: int = 1  # log tokens every k steps
    token_groups: int | None = 2  # ... for m groups (None = all)
    flush_every_steps: int = 10
    flush_every_s: float = 2.0
    detector: bool = True


@dataclass(frozen=True)
class TrainConfig:
    mode: str = "vanilla"
    steps: int = 12
    seed: int = 0
    threads: int = 1  # torch CPU threads; only used with deterministic = False (see below)
    # One CPU thread for the training math, whatever `threads` says: with 2 threads the same seed gives
    # log-probs that differ in the 7th digit from step 0 (measured), and sampling turns that into another
    # run. False lets `threads` speed up a large model on CPU at the price of bit-for-bit reruns.
    deterministic: bool = True
    # pinned: the same seed and config give the same bits on any x86-64 CPU with AVX2 (backend/numerics.py);
    # native: this CPU's fastest kernels (about 1.1-1.3x faster here), and another run on another CPU
    numerics: str = "pinned"
    device: str = "auto"  # auto | cpu | cuda
    model_path: str | None = None  # a local HF causal LM instead of the warm-started tiny model
    corpus: str | None = None  # JSONL corpus for the retriever (default: the generated world)
    retriever_url: str | None = None  # Search-R1 /retrieve server instead of local BM25
    world: WorldConfig = field(default_factory=WorldConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    llds: LLDSSettings = field(default_factory=LLDSSettings)
    log: LogSettings = field(default_factory=LogSettings)

    def __post_init__(self) -> None:
        if self.mode.replace("_", "-") not in MODES:
            raise ValueError(f"mode must be one of {MODES} (llds_ma is accepted too), got {self.mode!r}")
        # configs and the CLI spell it llds-ma; the store spells it llds_ma (schema.normalize_mode)
        object.__setattr__(self, "mode", self.mode.replace("_", "-"))
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.numerics!r}")
        g = self.grpo
        n = g.prompts_per_step * g.group_size
        if g.loss_agg not in LOSS_AGGS:
            raise ValueError(f"grpo.loss_agg must be one of {LOSS_AGGS}, got {g.loss_agg!r}")
        if g.embed_lr_scale < 0:
            raise ValueError("grpo.embed_lr_scale must be >= 0 (0 freezes the embedding)")
        if g.warmup_steps < 0:
            raise ValueError("grpo.warmup_steps must be >= 0")
        if g.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"grpo.lr_schedule must be constant or cosine, got {g.lr_schedule!r}")
        if not 0.0 <= g.min_lr_ratio <= 1.0:
            raise ValueError("grpo.min_lr_ratio must be in [0, 1]")
        if g.group_size < 2:
            raise ValueError("grpo.group_size must be >= 2 (group advantages need a group)")
        if g.num_minibatches < 1 or n % g.num_minibatches:
            raise ValueError(
                f"grpo.num_minibatches ({g.num_minibatches}) must divide prompts_per_step*group_size ({n})"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or 'top level'} must be a table/object")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown config key(s) in {where or 'top level'}: {', '.join(unknown)}; known: {', '.join(known)}")
    kw: dict[str, Any] = {}
    defaults = cls()
    for k, v in data.items():
        cur = getattr(defaults, k)
        if is_dataclass(cur):
            kw[k] = _build(type(cur), v, f"{where}.{k}" if where else k)
        elif isinstance(cur, tuple) and isinstance(v, list):
            kw[k] = tuple(v)
        else:
            kw[k] = v
    return cls(**kw)


def config_from_dict(data: dict) -> TrainConfig:
    return _build(TrainConfig, data, "")


def load_config(path: str | Path | None, **overrides) -> TrainConfig:
    """Read a JSON or TOML config file (or none) and apply top-level overrides that are not None."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}")
        text = p.read_text(encoding="utf-8")
        if p.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: not valid JSON ({e}); use .toml for TOML files") from e
    cfg = config_from_dict(data)
    ov = {k: v for k, v in overrides.items() if v is not None}
    return replace(cfg, **ov) if ov else cfg
