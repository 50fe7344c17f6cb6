"""Overhead of the LLDS term on one GRPO forward+backward of a small Qwen2 causal LM (CPU).

    .venv/bin/python bench/lld_overhead.py                 # defaults below, 1 thread, 7 repetitions
    .venv/bin/python bench/lld_overhead.py --threads 2 --reps 9 --json out.json

The model is built from a transformers ``Qwen2Config`` (random weights, nothing downloaded).
Each repetition times, per variant, forward -> float32 token log-probs -> loss -> backward:

    vanilla      ppo_clip_loss (PPO-clip, token mean) + 0.001 · k3 KL to a fixed reference
    llds         vanilla + 0.2 · llds_loss(gate="action", norm="response")      (paper default)
    llds_rgate   vanilla + 0.2 · llds_loss(gate="response")
    llds_code    vanilla + 0.2 · llds_loss(gate="action", norm="token_mean")    (official code)
    llds_ma      vanilla + 0.2 · llds_loss(A-gate, adaptive β "paper"), answer_span_mask included

Variants are interleaved inside every repetition (so machine load hits them alike); the figure is
the median over repetitions and its ratio to vanilla's median, both in wall time and in process CPU
time (with one thread, CPU time is what the step itself used: robust to other processes on a shared
machine), plus the median of per-repetition paired ratios. Also timed: each LLDS term alone (forward +
backward of llds_loss, and answer_span_mask for llds_ma, on a [B, T] log-prob tensor) and its share
of the vanilla step.
The batch mimics Search-R1: 3 actions per response separated by tool observations, an
``<answer> … </answer>`` span in the last action, right padding, GRPO groups of 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from lld_monitor.lld import (
    LLDSConfig,
    answer_span_mask,
    grpo_advantages,
    llds_loss,
    ppo_clip_loss,
    token_logprobs,
)

OPEN_IDS = [5, 6]  # "<answer>" as two token ids
CLOSE_IDS = [5, 7]  # "</answer>"


@dataclass
class BenchConfig:
    batch: int = 40
    seq: int = 200
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 352
    vocab: int = 1000
    threads: int = 1
    reps: int = 7
    warmup: int = 1
    seed: int = 0


def build_model(cfg: BenchConfig) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    mcfg = Qwen2Config(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(256, cfg.seq + 8),
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(mcfg)
    model.train()
    return model


def build_batch(cfg: BenchConfig) -> dict[str, torch.Tensor]:
    """Right-padded rows of [action | tool | action | tool | action with <answer> span | pad]."""
    g = torch.Generator().manual_seed(cfg.seed)
    b, t = cfg.batch, cfg.seq
    ids = torch.randint(10, cfg.vocab, (b, t + 1), generator=g)  # +1: next-token targets
    mask = torch.zeros(b, t, dtype=torch.bool)
    attn = torch.ones(b, t + 1, dtype=torch.long)
    for i in range(b):
        length = int(torch.randint(int(0.7 * t), t + 1, (1,), generator=g))
        a = max(length // 6, 6)  # action length; tool spans of the same order
        segs = [(0, a), (2 * a, 3 * a), (4 * a, length)]
        for s, e in segs:
            mask[i, s:e] = True
        s, e = segs[-1]
        if e - s >= 6:
            ids[i, 1 + s : 1 + s + 2] = torch.tensor(OPEN_IDS)
            ids[i, 1 + e - 2 : 1 + e] = torch.tensor(CLOSE_IDS)
        attn[i, length + 1 :] = 0
    rewards = (torch.rand(b, generator=g) < 0.4).float()
    adv = grpo_advantages(rewards, [i // 5 for i in range(b)])
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "attention_mask": attn[:, :-1], "mask": mask, "adv": adv}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, val in asdict(BenchConfig()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=val)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    json_path = args.json
    cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k != "json"})
    if cfg.reps < 1:
        ap.error("--reps must be ≥ 1")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    batch = build_batch(cfg)
    mask, adv, targets = batch["mask"], batch["adv"], batch["targets"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lp0 = token_logprobs(logits, targets)
        noise = torch.Generator().manual_seed(cfg.seed + 1)
        # "old" = 2nd-mini-batch-like drift, so that LLDS has tokens to penalize
        logp_old = lp0 + 0.05 * torch.randn(lp0.shape, generator=noise)
        logp_ref = lp0 + 0.05 * torch.randn(lp0.shape, generator=noise)
    valid_searches = 1.3
    variants: dict[str, LLDSConfig | None] = {
        "vanilla": None,
        "llds": LLDSConfig(gate="action", norm="response"),
        "llds_rgate": LLDSConfig(gate="response", norm="response"),
        "llds_code": LLDSConfig(gate="action", norm="token_mean"),
        "llds_ma": LLDSConfig(gate="action", adaptive_beta="paper"),
    }

    def step(cfg_llds: LLDSConfig | None) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logp = token_logprobs(out.logits, targets)
        loss, _ = ppo_clip_loss(logp, logp_old, adv, mask, clip_eps=0.2, logp_ref=logp_ref, kl_coef=0.001)
        if cfg_llds is not None:
            loss = loss + cfg_llds.lam * llds_term(logp, cfg_llds)
        loss.backward()
        return time.perf_counter() - t0, time.process_time() - c0

    def llds_term(logp: torch.Tensor, cfg_llds: LLDSConfig) -> torch.Tensor:
        am = answer_span_mask(batch["input_ids"], mask, OPEN_IDS, CLOSE_IDS) if cfg_llds.masks_answer else None
        term, _ = llds_loss(logp, logp_old, adv, mask, cfg_llds, answer_mask=am, valid_searches_mean=valid_searches)
        return term

    def term_only(cfg_llds: LLDSConfig) -> float:
        x = lp0.clone().requires_grad_(True)
        c0 = time.process_time()
        llds_term(x, cfg_llds).backward()
        return time.process_time() - c0

    llds_names = [k for k, v in variants.items() if v is not None]
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    term_cpu: dict[str, list[float]] = {k: [] for k in llds_names}
    total = (cfg.warmup + cfg.reps) * len(variants)
    with tqdm(total=total, desc="lld_overhead", file=sys.stderr) as bar:
        for rep in range(cfg.warmup + cfg.reps):
            order = list(variants) if rep % 2 == 0 else list(reversed(variants))
            for name in order:
                w, c = step(variants[name])
                if rep >= cfg.warmup:
                    wall[name].append(w)
                    cpu[name].append(c)
                bar.update(1)
            for name in llds_names:
                tt = term_only(variants[name])
                if rep >= cfg.warmup:
                    term_cpu[name].append(tt)

    def paired(series: dict[str, list[float]], k: str) -> float:
        return statistics.median(a / b for a, b in zip(series[k], series["vanilla"]))

    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    med_term = {k: statistics.median(v) for k, v in term_cpu.items()}
    result = {
        "config": asdict(cfg),
        "model": f"Qwen2ForCausalLM hidden={cfg.hidden} layers={cfg.layers} heads={cfg.heads}/{cfg.kv_heads} "
        f"ffn={cfg.intermediate} vocab={cfg.vocab} tied, {n_params / 1e6:.2f}M params",
        "action_tokens": int(mask.sum()),
        "torch": torch.__version__,
        "median_wall_s": med_wall,
        "median_cpu_s": med_cpu,
        "ratio_cpu_vs_vanilla": {k: med_cpu[k] / med_cpu["vanilla"] for k in variants},
        "paired_ratio_cpu_vs_vanilla": {k: paired(cpu, k) for k in variants},
        "ratio_wall_vs_vanilla": {k: med_wall[k] / med_wall["vanilla"] for k in variants},
        "term_only_median_cpu_ms": {k: 1e3 * v for k, v in med_term.items()},
        "term_only_over_vanilla_cpu": {k: v / med_cpu["vanilla"] for k, v in med_term.items()},
        "all_wall_s": wall,
        "all_cpu_s": cpu,
    }
    print(f"model: {result['model']}")
    print(f"batch {cfg.batch} x {cfg.seq} tokens ({result['action_tokens']} action tokens), "
          f"torch.set_num_threads({cfg.threads}), median of {cfg.reps} reps (+{cfg.warmup} warm-up), torch {torch.__version__}")
    print("one GRPO step = forward + float32 log-probs + loss + backward; CPU = process time (robust to other load)")
    print(f"{'variant':<12} {'wall s':>8} {'cpu s':>8} {'cpu ratio':>10} {'paired':>8} {'wall ratio':>11} {'term ms':>8} {'term/step':>10}")
    for k in variants:
        tm = result["term_only_median_cpu_ms"].get(k)
        tf = result["term_only_over_vanilla_cpu"].get(k)
        print(f"{k:<12} {med_wall[k]:>8.4f} {med_cpu[k]:>8.4f} {result['ratio_cpu_vs_vanilla'][k]:>10.4f} "
              f"{result['paired_ratio_cpu_vs_vanilla'][k]:>8.4f} {result['ratio_wall_vs_vanilla'][k]:>11.4f} "
              f"{'' if tm is None else f'{tm:.2f}':>8} {'' if tf is None else f'{100 * tf:.2f}%':>10}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
