"""Per-step displacement probe: from one training state, the same GRPO step as vanilla and as LLDS.

The paper's single-update probe (Eq. 3) measures how one update changes the likelihood of the batch's
correct responses. This probe measures that too, and the change on a fixed held-out set of correct
responses to *other* questions, which is what later steps sample from: does LLDS's in-batch protection
reach the population, and does vanilla's update displace it?

    .venv/bin/python scripts/probe_displacement.py --config scripts/spiral_config.json --pre 110 --probes 8 [--seed 1]

1. train `--pre` steps in `--pre-mode` (vanilla) from the warm start, as `lld-monitor train` would;
2. sample one response for each of `--heldout` random questions (seeded) and keep the correct ones;
3. for each of the next `--probes` steps: restore the state (model, optimizer; the lr follows the step), run the step
   as vanilla; restore, run it as LLDS (the config's `llds` section). Both arms see the same rollouts
   (same state, seeded sampling), so every difference between them is the regularizer's.

Printed per step and arm, in nats per response summed over its action tokens (+ = more likely after
the step): `A0c` the correct responses of all-correct groups (Â = 0: no policy gradient of their own),
`pos` (Â > 0), `neg` (Â < 0), `held` the held-out responses, and `fell` the share of held-out responses
whose likelihood fell; then the mean and median over the probed steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("probe_displacement")
FIELDS = ("A0c", "pos", "neg", "held", "fell")


def _mean(xs) -> float:
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else float("nan")


def arm_figures(delta, adv, reward) -> dict:
    """Mean Δ (per response) of the batch's A0c, pos and neg responses (numpy arrays of one step's samples)."""
    return {"A0c": _mean(delta[(adv == 0) & (reward > 0)]), "pos": _mean(delta[adv > 0]), "neg": _mean(delta[adv < 0])}


def probe(config: str | None, pre: int, probes: int, seed: int = 1, heldout: int = 240, pre_mode: str = "vanilla",
          progress: bool = True) -> dict:
    """Run the probe; returns {"reward_at_state", "heldout_correct", "steps": [{"step", "reward", "vanilla": {...},
    "llds": {...}}]} with the FIELDS of each arm."""
    import torch
    from tqdm import tqdm

    from lld_monitor import lld
    from lld_monitor.backend.config import load_config
    from lld_monitor.backend.env import format_prompt, rollout
    from lld_monitor.backend.grpo import Trainer
    from lld_monitor.backend.model import forward_logprobs
    from lld_monitor.backend.reward import em_reward
    from lld_monitor.roles import ROLE_ACTION

    cfg = load_config(config, mode=pre_mode, seed=seed)
    tr = Trainer(cfg, tempfile.gettempdir(), "probe", progress=False)  # steps are not logged: no store is written
    reward = float("nan")
    for s in tqdm(range(pre), desc=f"{pre_mode} steps before the probe", disable=not progress):
        reward = tr.step(s).scalars["critic/score/mean"]
    qs = random.Random(12345).sample(tr.world.questions, min(heldout, len(tr.world.questions)))
    ro = rollout(tr.model, tr.tok, [format_prompt(q.question, cfg.env) for q in qs], tr.retriever, cfg.env,
                 torch.Generator().manual_seed(999))
    ok = [i for i, (t, q) in enumerate(zip(ro.response_texts, qs)) if em_reward(t, q.answers) > 0]
    if not ok:
        raise RuntimeError("no held-out response is correct at this state; probe an earlier step (--pre)")
    h_ids, h_am = ro.input_ids[ok], ro.attention_mask[ok]
    h_act = (ro.response_mask & (ro.role == ROLE_ACTION))[ok]

    def heldout_ll():
        with torch.no_grad():
            lp, _ = forward_logprobs(tr.model, h_ids, h_am, ro.prompt_width, cfg.env.temperature, h_act)
        return (lp * h_act).sum(-1)

    state = copy.deepcopy((tr.model.state_dict(), tr.opt.state_dict()))
    base = heldout_ll()
    arms = {"vanilla": None, "llds": lld.LLDSConfig(lam=cfg.llds.lam, gate=cfg.llds.gate, norm=cfg.llds.norm)}
    out = {"reward_at_state": reward, "heldout_correct": len(ok), "heldout": len(qs), "steps": []}
    for step in tqdm(range(pre, pre + probes), desc="probed steps (both arms)", disable=not progress):
        row: dict = {"step": step}
        for arm, llds_cfg in arms.items():
            tr.model.load_state_dict(state[0])
            tr.opt.load_state_dict(state[1])
            tr.llds_cfg = llds_cfg
            smp = tr.step(step).samples
            d, adv, rew = smp["logp_new_sum"] - smp["logp_old_sum"], smp["advantage"], smp["reward"]
            dh = heldout_ll() - base
            row["reward"] = float(rew.mean())
            row[arm] = {**arm_figures(d, adv, rew), "held": float(dh.mean()), "fell": float((dh < 0).float().mean()),
                        "reward": float(rew.mean())}
        out["steps"].append(row)
    return out


def summary(res: dict) -> str:
    lines = [f"state: reward {res['reward_at_state']:.2f} at its last step; held-out: {res['heldout_correct']} correct "
             f"responses of {res['heldout']} questions",
             "| step | reward | arm | " + " | ".join(FIELDS) + " |", "|---" * (3 + len(FIELDS)) + "|"]
    for row in res["steps"]:
        for arm in ("vanilla", "llds"):
            r = row[arm]
            lines.append(f"| {row['step']} | {row['reward']:.2f} | {arm} | " + " | ".join(f"{r[f]:+.4f}" for f in FIELDS) + " |")
    for arm in ("vanilla", "llds"):
        for name, fn in (("mean", _mean), ("median", statistics.median)):
            vals = {f: fn([row[arm][f] for row in res["steps"]]) for f in FIELDS}
            lines.append(f"| {name} | | {arm} | " + " | ".join(f"{vals[f]:+.4f}" for f in FIELDS) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "scripts" / "spiral_config.json"))
    ap.add_argument("--pre", type=int, default=110, help="steps trained before the probe (default 110)")
    ap.add_argument("--probes", type=int, default=8, help="steps probed, each from the same state (default 8)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--heldout", type=int, default=240, help="held-out questions sampled once (default 240)")
    ap.add_argument("--pre-mode", default="vanilla", choices=("vanilla", "llds", "llds-ma"))
    ap.add_argument("--json", default=None, help="also write the per-step figures here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    res = probe(args.config, args.pre, args.probes, args.seed, args.heldout, args.pre_mode)
    print(summary(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
