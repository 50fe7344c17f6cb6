"""Cost of the verl hook's extra post-update ``compute_log_prob`` pass, relative to the actor's own work (CPU).

    .venv/bin/python -m bench.verl_logprob_cost                   # defaults below, 1 thread, 5 repetitions
    .venv/bin/python -m bench.verl_logprob_cost --reps 7 --json out.json

The hook (lld_monitor/integrations/trainers/verl_hook.py) runs one more forward pass of the actor over the step's batch
after verl's update. Per repetition, interleaved, on a small Qwen2 built from a config (random weights):

    update     verl's actor update with ppo_epochs = 1, one mini-batch: forward with grad -> float32 token
               log-probs -> PPO-clip loss -> backward -> AdamW step
    log_prob   what compute_log_prob does: a no-grad forward -> float32 token log-probs

Printed: the medians, ``log_prob / update`` (what the hook logs as perf/lld_post_update_log_prob_share with
ppo_epochs = 1) and the extra pass's share of the actor's step work when verl also runs its own old-log-prob pass
(update + old_log_prob) and a reference pass (update + old_log_prob + ref). On GPUs the ratio of a forward to a
forward + backward is also about 1 : 3 in FLOPs; this bench measures it on the CPU it runs on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from bench.common import machine
from lld_monitor.lld import ppo_clip_loss, token_logprobs


@dataclass
class CostConfig:
    batch: int = 16
    seq: int = 256
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 704
    vocab: int = 2000
    threads: int = 1
    reps: int = 5


def run(cfg: CostConfig) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq + 8, tie_word_embeddings=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    resp = cfg.seq // 2
    targets = ids[:, -resp:]
    mask = torch.ones(cfg.batch, resp, dtype=torch.bool)
    adv = torch.randn(cfg.batch)
    with torch.no_grad():
        old = token_logprobs(model(input_ids=ids).logits[:, -resp - 1 : -1], targets)

    def update() -> None:
        model.train()
        lp = token_logprobs(model(input_ids=ids).logits[:, -resp - 1 : -1], targets)
        loss, _ = ppo_clip_loss(lp, old, adv, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def log_prob() -> None:
        model.eval()
        with torch.no_grad():
            token_logprobs(model(input_ids=ids).logits[:, -resp - 1 : -1], targets)

    times: dict[str, list[float]] = {"update": [], "log_prob": []}
    update(), log_prob()  # warm-up
    for _ in range(cfg.reps):
        for name, fn in (("update", update), ("log_prob", log_prob)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    u = statistics.median(times["update"])
    f = statistics.median(times["log_prob"])
    return {
        "config": asdict(cfg),
        "machine": machine(),
        "update_s": u,
        "log_prob_s": f,
        "log_prob_over_update": f / u,
        "share_of_update_plus_old_log_prob": f / (u + f),
        "share_of_update_plus_old_and_ref_log_prob": f / (u + 2 * f),
        "times": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=CostConfig.reps)
    ap.add_argument("--threads", type=int, default=CostConfig.threads)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = ap.parse_args()
    res = run(CostConfig(reps=a.reps, threads=a.threads))
    m = res["machine"]
    print(f"{m.get('cpu_model', m['processor'])}, {res['config']['threads']} thread(s), "
          f"batch {res['config']['batch']} x {res['config']['seq']} tokens, median of {res['config']['reps']}")
    print(f"update (fwd+bwd+AdamW)  {res['update_s']:.3f} s")
    print(f"log_prob (no-grad fwd)  {res['log_prob_s']:.3f} s   = {100 * res['log_prob_over_update']:.0f} % of the update")
    print(f"share of update + old_log_prob:        +{100 * res['log_prob_s'] / (res['update_s'] + res['log_prob_s']):.0f} %")
    print(f"share of update + old_log_prob + ref:  "
          f"+{100 * res['log_prob_s'] / (res['update_s'] + 2 * res['log_prob_s']):.0f} %")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
