"""GRPO for the Search-R1 environment, with vanilla / LLDS / LLDS-MA, logging through RunLogger.

One step (as verl's ray_trainer + dp_actor, scaled down):
1. sample `prompts_per_step` questions (this rank's share), roll out G episodes each (no grad);
2. exact-match rewards, group advantages (`lld.grpo_advantages`);
3. one forward of the rollout policy (π_old = the parameters at the start of the step) and of the
   frozen reference; tool tokens are masked from everything below;
4. `ppo_epochs × num_minibatches` optimizer updates on contiguous mini-batches (PPO-clip, optional
   k3 KL and entropy bonus, + λ·L_LLDS in llds modes), each with the pre-clip grad norm recorded;
5. one more forward after the last update (π_after) on the same tokens: Δ = ln π_after − ln π_old;
6. log the step, every sample and (sampled) every token.

Under `torchrun` (env RANK/WORLD_SIZE) the model is wrapped in DDP (gloo on CPU, nccl on GPU);
each rank rolls out its share of prompts and logs its own samples; rank 0 logs the step row from
all ranks' samples.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass, replace

from .config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistInfo:
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    if ws <= 1:
        return DistInfo()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def _pick_device(pref: str, dist: DistInfo):
    import torch

    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but no GPU is available; use --device cpu")
        return torch.device("cuda", dist.local_rank)
    return torch.device("cpu")


def token_texts(tok) -> list[str]:
    """Each token id's text as it reads inside a response, leading space included, for the token inspector.

    A word-level vocabulary (the built-in world's) holds whole words, so each reads as " word". For
    other vocabularies, decoding an id after an anchor token and dropping the anchor's text gives
    " word" for byte-level BPE and "ing" for a continuation piece. `convert_ids_to_tokens` alone gives
    raw pieces ("word", "Ġword") that run together or show markers.
    """
    n = len(tok)
    special = set(tok.all_special_ids)
    pieces = tok.convert_ids_to_tokens(list(range(n)))
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "WordLevel":
        return [p if i in special else " " + p for i, p in enumerate(pieces)]
    anchor = next(i for i in range(n) if i not in special)
    head = tok.decode([anchor])
    out = []
    for i in range(n):
        text = tok.decode([anchor, i])
        out.append(pieces[i] if i in special else (text[len(head):] if text.startswith(head) else tok.decode([i])))
    return out


def cpu_threads(cfg: TrainConfig) -> int:
    """Torch intra-op threads for this run: 1 when `cfg.deterministic` (the default), else `cfg.threads`.

    The thread count changes the order of floating-point reductions, so a run's numbers depend on it;
    pinning it makes a seed + config one run, whoever launches it (train, demo, torchrun, a script).
    """
    if cfg.deterministic and cfg.threads != 1:
        log.warning("threads=%d ignored: deterministic=true computes on 1 CPU thread so that a seed gives the same "
                    "run bit-for-bit; set deterministic=false in the config to use more threads", cfg.threads)
    return 1 if cfg.deterministic else cfg.threads


class Trainer:
    """Builds everything from a TrainConfig; `train()` runs the steps and returns the run id."""

    def __init__(self, cfg: TrainConfig, store: str, run_name: str, progress: bool = True, run_id: str | None = None):
        from . import numerics

        numerics.require(cfg.numerics)  # before torch loads: the pinned kernels are chosen then
        import torch

        from .adamw import AdamW
        from .model import load_model
        from .retriever import BM25Retriever, HTTPRetriever, load_jsonl_corpus
        from .sft import warmstart
        from .world import build_world

        self.store = store
        self.run_name = run_name
        self.progress = progress
        self.run_id = run_id
        torch.set_num_threads(cpu_threads(cfg))
        self.dist = init_distributed("cuda" if cfg.device == "cuda" else "cpu")
        self.device = _pick_device(cfg.device, self.dist)
        if self.device.type != "cpu" and cfg.numerics == "pinned":
            log.warning("pinned numerics are CPU kernels; on %s this run uses the device's native kernels", self.device)
            cfg = replace(cfg, numerics="native")
        self.cfg = cfg
        self.world = build_world(cfg.world)
        if cfg.model_path:
            self.model, self.tok = load_model(cfg.model_path, "cpu")
            self.model_name = str(cfg.model_path)
        else:
            def load():
                return warmstart(cfg.world, cfg.model, cfg.sft, cfg.env, self.world, numerics=cfg.numerics)

            if self.dist.enabled:  # rank 0 trains/caches the warm start first; the others then load it
                import torch.distributed as tdist

                if self.dist.rank == 0:
                    self.model, self.tok, ckpt = load()
                tdist.barrier()
                if self.dist.rank != 0:
                    self.model, self.tok, ckpt = load()
            else:
                self.model, self.tok, ckpt = load()
            self.model_name = f"qwen2-tiny (warm start {ckpt.name})"
        if cfg.retriever_url:
            self.retriever = HTTPRetriever(cfg.retriever_url)
        elif cfg.corpus:
            self.retriever = BM25Retriever(load_jsonl_corpus(cfg.corpus))
        else:
            self.retriever = BM25Retriever(self.world.documents)
        self.model.to(self.device)
        self.ref = None
        if cfg.grpo.log_ref or cfg.grpo.kl_coef > 0:
            import copy

            self.ref = copy.deepcopy(self.model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        g = cfg.grpo
        params = self._param_groups(g)
        self.ddp = self.model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        # verl's schedule, set at each step (adamw.lr_at): linear warm-up over `warmup_steps` GRPO steps, then
        # constant (Search-R1's official GRPO run warms up over 286 of its 1005 steps)
        self.opt = AdamW(params, lr=g.lr, betas=tuple(g.betas), weight_decay=g.weight_decay)
        self.open_ids = self.tok.encode("<answer>", add_special_tokens=False)
        self.close_ids = self.tok.encode("</answer>", add_special_tokens=False)
        self.llds_cfg = self._llds_config()
        if g.prompts_per_step % self.dist.world_size:
            raise ValueError(f"grpo.prompts_per_step ({g.prompts_per_step}) must be divisible by the world size ({self.dist.world_size})")
        n_local = g.prompts_per_step // self.dist.world_size * g.group_size
        if n_local % g.num_minibatches:
            raise ValueError(f"per-rank rollouts ({n_local}) must be divisible by grpo.num_minibatches ({g.num_minibatches})")

    def _llds_config(self):
        from lld_monitor import lld

        s = self.cfg.llds
        if self.cfg.mode == "vanilla":
            return None
        if self.cfg.mode == "llds":
            return lld.LLDSConfig(lam=s.lam, gate=s.gate, norm=s.norm)
        if s.ma_answer_weight is not None:
            return lld.LLDSConfig(lam=s.lam, gate=s.gate, norm=s.norm, answer_weight=s.ma_answer_weight)
        return lld.LLDSConfig(lam=s.lam, gate=s.gate, norm=s.norm, adaptive_beta=s.ma_adaptive_beta, v_base=s.v_base)

    # ------------------------------------------------------------------ one step
    def _prompts(self, step: int):
        g = self.cfg.grpo
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        qs = rng.sample(self.world.questions, g.prompts_per_step)
        per = g.prompts_per_step // self.dist.world_size
        mine = list(range(self.dist.rank * per, (self.dist.rank + 1) * per))
        return [(i, qs[i]) for i in mine]

    def step(self, step: int) -> dict:
        import torch

        from lld_monitor import lld
        from lld_monitor.store.schema import ROLE_ACTION, ROLE_ANSWER

        from .adamw import lr_at
        from .env import format_prompt, rollout
        from .model import forward_logprobs
        from .reward import em_reward

        cfg, g = self.cfg, self.cfg.grpo
        t0 = time.perf_counter()
        picked = self._prompts(step)
        rows = [(i, q) for i, q in picked for _ in range(g.group_size)]
        gen = torch.Generator(device=self.device).manual_seed((cfg.seed * 7919 + step) * 131 + self.dist.rank)
        ro = rollout(self.model, self.tok, [format_prompt(q.question, cfg.env) for _, q in rows], self.retriever, cfg.env, gen)
        t_gen = time.perf_counter() - t0
        rewards = torch.tensor([em_reward(t, q.answers) for t, (_, q) in zip(ro.response_texts, rows)], dtype=torch.float32)
        group_ids = [f"{step}:{i}" for i, _ in rows]
        adv = lld.grpo_advantages(rewards, group_ids)
        dev = self.device
        ids, am, P = ro.input_ids.to(dev), ro.attention_mask.to(dev), ro.prompt_width
        act = (ro.response_mask & (ro.role == ROLE_ACTION)).to(dev)
        ans = lld.answer_span_mask(ro.response_ids.to(dev), act, self.open_ids, self.close_ids)
        role = ro.role.clone()
        role[ans.cpu()] = ROLE_ANSWER
        temp = cfg.env.temperature
        with torch.no_grad():
            logp_old, ent_old = forward_logprobs(self.model, ids, am, P, temp, act)
            logp_ref = forward_logprobs(self.ref, ids, am, P, temp, act)[0] if self.ref is not None else None
        t_ref = time.perf_counter() - t0 - t_gen
        vs_mean = float(sum(ro.n_searches)) / len(rows)
        if self.dist.enabled:
            import torch.distributed as dist

            t = torch.tensor([vs_mean], dtype=torch.float64)
            dist.all_reduce(t)
            vs_mean = float(t.item()) / self.dist.world_size
        # ---- updates
        self.opt.set_lr_factor(lr_at(step, g.warmup_steps, g.lr_schedule, cfg.steps, g.min_lr_ratio))
        n = len(rows)
        mb = n // g.num_minibatches
        upd = {k: [] for k in ("grad_norm", "clip_frac", "kl", "pg_loss", "llds_loss", "entropy", "ppo_kl", "reduce_chunk", "beta", "loss")}
        self.model.train()
        adv_d = adv.to(dev)
        for _epoch in range(g.ppo_epochs):
            for b in range(g.num_minibatches):
                sl = slice(b * mb, (b + 1) * mb)
                # trim the mini-batch to its own longest response
                width = int(am[sl, P:].sum(-1).max().item()) if mb else 0
                width = max(width, 1)
                x, a = ids[sl, : P + width], am[sl, : P + width]
                m = act[sl, :width]
                lo = logp_old[sl, :width]
                lr_ = logp_ref[sl, :width] if logp_ref is not None else None
                logp, ent = forward_logprobs(self.ddp, x, a, P, temp, m)
                loss, st = lld.ppo_clip_loss(logp, lo, adv_d[sl], m, g.clip_eps, logp_ref=lr_, kl_coef=g.kl_coef, agg=g.loss_agg)
                ent_mean = (ent * m).sum() / m.sum().clamp(min=1)
                if g.entropy_coef:
                    loss = loss - g.entropy_coef * ent_mean
                llds_val = 0.0
                if self.llds_cfg is not None:
                    l_llds, lst = lld.llds_loss(
                        logp, lo, adv_d[sl], m, self.llds_cfg, answer_mask=ans[sl, :width], valid_searches_mean=vs_mean
                    )
                    loss = loss + self.llds_cfg.lam * l_llds
                    llds_val = self.llds_cfg.lam * float(l_llds.detach())
                    upd["beta"].append(float(lst.get("beta", 1.0)))
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.grad_clip)
                self.opt.step()
                with torch.no_grad():
                    ds = lld.displacement(logp.detach(), lo, m)
                    pre = (adv_d[sl] >= 0) & (m.sum(-1) > 0)
                    n_fell = ((ds.action_sum < 0) & ds.action_valid).sum(-1).float()
                    upd["reduce_chunk"].append(float(n_fell[pre].mean()) if pre.any() else float("nan"))
                upd["grad_norm"].append(float(gn))
                upd["clip_frac"].append(st["clip_frac"])
                upd["kl"].append(st["kl"])
                upd["pg_loss"].append(st["pg_loss"])
                upd["ppo_kl"].append(st.get("approx_kl", float("nan")))
                upd["llds_loss"].append(llds_val)
                upd["entropy"].append(float(ent_mean.detach()))
                upd["loss"].append(float(loss.detach()))
        lr_step = self.opt.param_groups[0]["lr"]
        t_upd = time.perf_counter() - t0 - t_gen - t_ref
        with torch.no_grad():
            logp_new, _ = forward_logprobs(self.model, ids, am, P, temp, act)
        step_time = time.perf_counter() - t0
        return self._log_payload(step, ro, rows, rewards, adv, group_ids, act, ans, role, logp_old, logp_new, logp_ref,
                                 ent_old, upd, vs_mean, dict(step=step_time, gen=t_gen, ref=t_ref, update_actor=t_upd),
                                 lr_step)

    def _log_payload(self, step, ro, rows, rewards, adv, group_ids, act, ans, role, logp_old, logp_new, logp_ref,
                     ent_old, upd, vs_mean, timing, lr_now) -> dict:
        import numpy as np
        import torch

        from lld_monitor import lld
        from lld_monitor.aggregates import sample_sums_from_tokens

        def mean(xs):
            xs = [x for x in xs if not (isinstance(x, float) and math.isnan(x))]
            return float(sum(xs) / len(xs)) if xs else float("nan")

        actf = act.float()
        n_tok_all = actf.sum().clamp(min=1)
        lo_m = torch.where(act, logp_old, torch.zeros_like(logp_old))
        pos_mask = (adv >= 0).to(act.device).unsqueeze(1)
        ent_action = float((ent_old * actf).sum() / n_tok_all)
        ansf = ans.float()
        answer_prob = float((torch.exp(logp_old) * ansf).sum() / ansf.sum()) if ansf.sum() > 0 else float("nan")
        scalars = {
            "entropy": ent_action,
            "grad_norm": mean(upd["grad_norm"]),
            "clip_frac": mean(upd["clip_frac"]),
            "kl": mean(upd["kl"]) if logp_ref is not None else float("nan"),
            "pg_loss": mean(upd["pg_loss"]),
            "llds_loss": mean(upd["llds_loss"]),
            "answer_prob_mean": answer_prob,
            "lr": lr_now,
            "step_time": timing["step"],
            # verl-named equivalents (so the detector can be evaluated on verl-only columns)
            "actor/pos_avg_old_log_prob": float((lo_m * pos_mask).sum() / n_tok_all),
            "actor/neg_avg_old_log_prob": float((lo_m * ~pos_mask).sum() / n_tok_all),
            "actor/entropy_loss": mean(upd["entropy"]),
            "actor/grad_norm": mean(upd["grad_norm"]),
            "actor/ppo_kl": mean(upd["ppo_kl"]),
            "actor/pg_clipfrac": mean(upd["clip_frac"]),
            "actor/pg_loss": mean(upd["pg_loss"]),
            "actor/loss_noreduce": mean(upd["llds_loss"]),
            "actor/mean_reduce_chunk": mean(upd["reduce_chunk"]),
            "actor/lr": lr_now,
            "critic/score/mean": float(rewards.mean()),
            "critic/advantages/mean": float(adv.mean()),
            "env/number_of_valid_search": vs_mean,
            "env/number_of_actions/mean": float(np.mean(ro.n_actions)),
            "env/finish_ratio": float(np.mean(ro.finished)),
            "env/number_of_valid_action": float(np.mean(ro.n_valid_actions)),
            "response_length/mean": float(ro.response_mask.sum(-1).float().mean()),
            "timing_s/step": timing["step"],
            "timing_s/gen": timing["gen"],
            "timing_s/ref": timing["ref"],
            "timing_s/update_actor": timing["update_actor"],
            "lld/updates_per_step": float(len(upd["grad_norm"])),
            "lld/grad_norm_max": max(upd["grad_norm"]) if upd["grad_norm"] else float("nan"),
        }
        if logp_ref is not None:
            lr_m = torch.where(act, logp_ref, torch.zeros_like(logp_ref))
            scalars["actor/pos_avg_ref_log_prob"] = float((lr_m * pos_mask).sum() / n_tok_all)
            scalars["actor/neg_avg_ref_log_prob"] = float((lr_m * ~pos_mask).sum() / n_tok_all)
            scalars["actor/kl_loss"] = scalars["kl"]
        if upd["beta"]:
            scalars["actor/answer_weight"] = mean(upd["beta"])
        # ---- per sample (exact every step): action-token sums as every other path computes them
        sums = sample_sums_from_tokens({"mask": act, "logp_old": logp_old, "logp_new": logp_new,
                                        "action_idx": lld.action_index(act)})
        samples = {
            "sample_idx": np.arange(len(rows), dtype=np.int32),
            "prompt_id": [q.qid for _, q in rows],
            "group_id": group_ids,
            "reward": rewards.numpy().astype(np.float64),
            "advantage": adv.numpy().astype(np.float64),
            "correct": (rewards > 0).numpy(),
            "n_searches": np.asarray(ro.n_searches, dtype=np.int32),
            **sums,
            "question": [q.question for _, q in rows],
            "gold": [" | ".join(q.answers) for _, q in rows],
            "text": ro.response_texts,
        }
        tokens = None
        le = self.cfg.log
        if le.token_every > 0 and step % le.token_every == 0 and le.token_groups != 0:
            nan = torch.full_like(logp_old, float("nan"))
            tokens = {
                "token_id": ro.response_ids,
                "mask": ro.response_mask,
                "role": role,
                "action_idx": lld.action_index(act),
                "logp_old": torch.where(act, logp_old, nan),
                "logp_new": torch.where(act, logp_new, nan),
                "entropy": torch.where(act, ent_old, nan),
            }
            if logp_ref is not None:
                tokens["logp_ref"] = torch.where(act, logp_ref, nan)
        return {"scalars": scalars, "samples": samples, "tokens": tokens}

    # ------------------------------------------------------------------ the loop
    def _gather_samples(self, samples: dict) -> dict | None:
        if not self.dist.enabled:
            return None
        import numpy as np
        import torch.distributed as dist

        parts = [None] * self.dist.world_size
        dist.all_gather_object(parts, samples)
        if self.dist.rank != 0:
            return None
        out = {}
        for k in samples:
            vals = [p[k] for p in parts]
            out[k] = np.concatenate([np.asarray(v) for v in vals]) if not isinstance(vals[0], list) else sum(vals, [])
        return out

    def _param_groups(self, g):
        """The optimizer's parameters: one group, or the token embedding apart at `g.embed_lr_scale` x lr."""
        if g.embed_lr_scale == 1.0:
            return list(self.model.parameters())
        emb = self.model.get_input_embeddings().weight
        rest = [p for p in self.model.parameters() if p is not emb]
        if g.embed_lr_scale == 0:
            emb.requires_grad_(False)  # tied: the output head is frozen with it
            return rest
        return [{"params": rest}, {"params": [emb], "lr": g.lr * g.embed_lr_scale}]

    def train(self, steps: int | None = None, on_step=None) -> str:
        from tqdm import tqdm

        from lld_monitor.aggregates import step_aggregates
        from lld_monitor.detect import OnlineDetector
        from lld_monitor.logger import RunLogger
        from lld_monitor.store.schema import normalize_mode

        steps = self.cfg.steps if steps is None else steps
        run_id = self.run_id
        if self.dist.enabled and run_id is None:
            import torch.distributed as dist

            holder = [None]
            if self.dist.rank == 0:
                from lld_monitor.store.layout import new_run_id  # type: ignore[attr-defined]

                holder[0] = new_run_id(self.run_name)
            dist.broadcast_object_list(holder, src=0)
            run_id = holder[0]
        le = self.cfg.log
        mode = normalize_mode(self.cfg.mode)
        try:
            vocab = token_texts(self.tok)
        except Exception:  # noqa: BLE001 - token texts are a nicety
            vocab = None
        detector = OnlineDetector() if self.dist.rank == 0 else None
        logger = RunLogger(
            self.store, self.run_name, mode, self.cfg.to_dict(), source="local", model=self.model_name, run_id=run_id,
            rank=self.dist.rank, world_size=self.dist.world_size, flush_every_steps=le.flush_every_steps,
            flush_every_s=le.flush_every_s, token_every=le.token_every, token_groups=le.token_groups, vocab=vocab,
            detector=le.detector,
        )
        status = "finished"
        bar = tqdm(range(steps), desc=f"{self.cfg.mode} seed {self.cfg.seed}", disable=not self.progress or self.dist.rank != 0,
                   dynamic_ncols=True)
        try:
            for s in bar:
                payload = self.step(s)
                all_s = self._gather_samples(payload["samples"])
                logger.log_step(s, scalars=payload["scalars"] if self.dist.rank == 0 else None,
                                samples=payload["samples"], tokens=payload["tokens"], all_samples=all_s)
                if self.dist.rank == 0:
                    agg = step_aggregates(all_s if all_s is not None else payload["samples"])  # what the logger writes
                    rw = float(agg["reward_mean"])
                    phase = "-"
                    if detector is not None:
                        sig = {**payload["scalars"], **agg}
                        try:
                            detector.update(s, sig)
                            phase = detector.phase
                        except Exception:  # noqa: BLE001
                            log.exception("detector failed; the bar shows no phase")
                            detector = None
                    d = agg.get("delta_preserved")
                    d = float("nan") if d is None else d
                    bar.set_postfix(reward=f"{rw:.3f}", delta=f"{d:+.3f}", phase=phase, gn=f"{payload['scalars']['grad_norm']:.2f}")
                if on_step is not None:
                    on_step(s, payload)
        except KeyboardInterrupt:
            log.warning("interrupted: finishing the run cleanly (steps logged so far are kept)")
            status = "finished"
        except BaseException:
            status = "crashed"
            logger.close(status="crashed")
            raise
        finally:
            bar.close()
        logger.close(status=status)
        return logger.run_id
