"""GRPO for the Search-R1 environment, with vanilla / LLDS / LLDS-MA, logging through RunLogger.

One step (`Trainer.step`, as verl's ray_trainer + dp_actor, scaled down):
1. rollout: sample `prompts_per_step` questions (this rank's share), roll out G episodes each (no grad);
2. rewards and advantages: exact-match rewards, group advantages (`lld.grpo_advantages`);
3. score before: one forward of the rollout policy (π_old = the parameters at the start of the step) and of
   the frozen reference; tool tokens are masked from everything below;
4. updates: `ppo_epochs × num_minibatches` optimizer updates on contiguous mini-batches (PPO-clip, optional
   k3 KL and entropy bonus, + λ·L_LLDS in llds modes), each with the pre-clip grad norm recorded;
5. score after: one more forward after the last update (π_after) on the same tokens: Δ = ln π_after − ln π_old;
6. log: the step's scalars, every sample and (sampled) every token, as `payload.step_payload` builds them for
   every trainer.

Under `torchrun` (env RANK/WORLD_SIZE) the model is wrapped in DDP (gloo on CPU, nccl on GPU); each rank rolls
out its share of prompts and logs its own samples; rank 0 logs the step row from all ranks' samples.

This module imports torch: in a process that trains with pinned numerics, `numerics.require` (or
`numerics.pin_environment`) must run before it is imported (`lld-monitor train` does).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from lld_monitor import lld
from lld_monitor.logger import RunLogger
from lld_monitor.payload import StepPayload, authors_scalars, step_payload
from lld_monitor.roles import ROLE_ACTION
from lld_monitor.store.layout import new_run_id
from lld_monitor.store.schema import normalize_mode

from . import numerics
from .adamw import AdamW, lr_at
from .config import TrainConfig
from .env import Rollout, format_prompt, rollout
from .model import forward_logprobs, load_model
from .retriever import BM25Retriever, HTTPRetriever, load_jsonl_corpus
from .reward import em_reward
from .sft import warmstart
from .world import Question, build_world

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
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(torch_dist.get_rank(), torch_dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def _pick_device(pref: str, dist: DistInfo) -> torch.device:
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


@dataclass
class StepBatch:
    """A step's rollouts and their masks, response-side [N, T] (input_ids and attention_mask are [N, P+T])."""

    rows: list[tuple[int, Question]]  # (prompt index, question) per rollout, G in a row per prompt
    group_ids: list[str]
    episodes: Rollout
    input_ids: Tensor
    attention_mask: Tensor
    prompt_width: int
    model_mask: Tensor  # the tokens the policy generated (actions; the answer span included)
    answer_mask: Tensor  # the final answer span


@dataclass
class Scores:
    """ln π of the response tokens under the rollout policy (and its entropy) and the frozen reference."""

    logp_old: Tensor
    entropy_old: Tensor
    logp_ref: Tensor | None


@dataclass
class UpdateStats:
    """What each optimizer update of a step measured, in update order."""

    grad_norm: list[float] = field(default_factory=list)
    clip_frac: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    pg_loss: list[float] = field(default_factory=list)
    ppo_kl: list[float] = field(default_factory=list)
    llds_loss: list[float] = field(default_factory=list)  # λ·L_LLDS of the update
    entropy: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    reduce_chunk: list[float] = field(default_factory=list)  # displaced actions per preserved response
    beta: list[float] = field(default_factory=list)  # LLDS-MA's answer weight


def _mean(xs: list[float]) -> float:
    """The mean of the finite-or-inf values (NaN left out); NaN when none is left."""
    xs = [x for x in xs if not (isinstance(x, float) and math.isnan(x))]
    return float(sum(xs) / len(xs)) if xs else float("nan")


class Trainer:
    """Builds everything from a TrainConfig; `train()` runs the steps and returns the run id."""

    def __init__(self, cfg: TrainConfig, store: str, run_name: str, progress: bool = True, run_id: str | None = None):
        numerics.require(cfg.numerics)  # raises if torch loaded without the pinned kernels' environment
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
                if self.dist.rank == 0:
                    self.model, self.tok, ckpt = load()
                torch_dist.barrier()
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
            self.ref = copy.deepcopy(self.model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        g = cfg.grpo
        params = self._param_groups(g)
        self.ddp = self.model
        if self.dist.enabled:
            self.ddp = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
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

    def _llds_config(self) -> lld.LLDSConfig | None:
        s = self.cfg.llds
        if self.cfg.mode == "vanilla":
            return None
        if self.cfg.mode == "llds":
            return lld.LLDSConfig(lam=s.lam, gate=s.gate, norm=s.norm)
        if s.ma_answer_weight is not None:
            return lld.LLDSConfig(lam=s.lam, gate=s.gate, norm=s.norm, answer_weight=s.ma_answer_weight)
        return lld.LLDSConfig(lam=s.lam, gate=s.gate, norm=s.norm, adaptive_beta=s.ma_adaptive_beta, v_base=s.v_base)

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> StepPayload:
        """One GRPO step (the module docstring's six stages); returns what it logs."""
        t0 = time.perf_counter()
        batch = self._rollout(step)
        t_gen = time.perf_counter() - t0
        rewards, advantages = self._rewards_and_advantages(batch)
        scores = self._score_before(batch)
        t_ref = time.perf_counter() - t0 - t_gen
        searches_mean = self._searches_mean(batch)
        updates = self._update(step, batch, advantages, scores, searches_mean)
        t_upd = time.perf_counter() - t0 - t_gen - t_ref
        logp_new = self._score_after(batch)
        timing = {"step": time.perf_counter() - t0, "gen": t_gen, "ref": t_ref, "update_actor": t_upd}
        return self._payload(step, batch, rewards, advantages, scores, logp_new, updates, searches_mean, timing)

    def _prompts(self, step: int) -> list[tuple[int, Question]]:
        g = self.cfg.grpo
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        qs = rng.sample(self.world.questions, g.prompts_per_step)
        per = g.prompts_per_step // self.dist.world_size
        mine = list(range(self.dist.rank * per, (self.dist.rank + 1) * per))
        return [(i, qs[i]) for i in mine]

    def _rollout(self, step: int) -> StepBatch:
        cfg = self.cfg
        rows = [(i, q) for i, q in self._prompts(step) for _ in range(cfg.grpo.group_size)]
        gen = torch.Generator(device=self.device).manual_seed((cfg.seed * 7919 + step) * 131 + self.dist.rank)
        episodes = rollout(self.model, self.tok, [format_prompt(q.question, cfg.env) for _, q in rows], self.retriever,
                           cfg.env, gen)
        dev = self.device
        model_mask = (episodes.response_mask & (episodes.role == ROLE_ACTION)).to(dev)
        answer_mask = lld.answer_span_mask(episodes.response_ids.to(dev), model_mask, self.open_ids, self.close_ids)
        return StepBatch(rows, [f"{step}:{i}" for i, _ in rows], episodes, episodes.input_ids.to(dev),
                         episodes.attention_mask.to(dev), episodes.prompt_width, model_mask, answer_mask)

    def _rewards_and_advantages(self, batch: StepBatch) -> tuple[Tensor, Tensor]:
        rewards = torch.tensor([em_reward(text, q.answers) for text, (_, q) in zip(batch.episodes.response_texts, batch.rows)],
                               dtype=torch.float32)
        return rewards, lld.grpo_advantages(rewards, batch.group_ids)

    def _logprobs(self, model, batch: StepBatch, rows: slice = slice(None), width: int | None = None):
        p = batch.prompt_width
        cut = p + width if width is not None else None
        return forward_logprobs(model, batch.input_ids[rows, :cut], batch.attention_mask[rows, :cut], p,
                                self.cfg.env.temperature, batch.model_mask[rows, :width])

    def _score_before(self, batch: StepBatch) -> Scores:
        with torch.no_grad():
            logp_old, entropy_old = self._logprobs(self.model, batch)
            logp_ref = self._logprobs(self.ref, batch)[0] if self.ref is not None else None
        return Scores(logp_old, entropy_old, logp_ref)

    def _searches_mean(self, batch: StepBatch) -> float:
        """Valid searches per rollout over all ranks (LLDS-MA's V)."""
        mean = float(sum(batch.episodes.n_searches)) / len(batch.rows)
        if self.dist.enabled:
            t = torch.tensor([mean], dtype=torch.float64)
            torch_dist.all_reduce(t)
            mean = float(t.item()) / self.dist.world_size
        return mean

    def _update(self, step: int, batch: StepBatch, advantages: Tensor, scores: Scores, searches_mean: float) -> UpdateStats:
        g = self.cfg.grpo
        self.opt.set_lr_factor(lr_at(step, g.warmup_steps, g.lr_schedule, self.cfg.steps, g.min_lr_ratio))
        size = len(batch.rows) // g.num_minibatches
        stats = UpdateStats()
        self.model.train()
        advantages = advantages.to(self.device)
        for _epoch in range(g.ppo_epochs):
            for b in range(g.num_minibatches):
                self._update_minibatch(slice(b * size, (b + 1) * size), batch, advantages, scores, searches_mean, stats)
        return stats

    def _update_minibatch(self, rows: slice, batch: StepBatch, advantages: Tensor, scores: Scores, searches_mean: float,
                          stats: UpdateStats) -> None:
        g = self.cfg.grpo
        # trimmed to the mini-batch's own longest response
        width = max(int(batch.attention_mask[rows, batch.prompt_width:].sum(-1).max().item()), 1)
        mask = batch.model_mask[rows, :width]
        logp_old = scores.logp_old[rows, :width]
        logp_ref = scores.logp_ref[rows, :width] if scores.logp_ref is not None else None
        adv = advantages[rows]
        logp, entropy = self._logprobs(self.ddp, batch, rows, width)
        loss, pg = lld.ppo_clip_loss(logp, logp_old, adv, mask, g.clip_eps, logp_ref=logp_ref, kl_coef=g.kl_coef,
                                     agg=g.loss_agg)
        entropy_mean = (entropy * mask).sum() / mask.sum().clamp(min=1)
        if g.entropy_coef:
            loss = loss - g.entropy_coef * entropy_mean
        llds_value = 0.0
        if self.llds_cfg is not None:
            llds_term, llds_stats = lld.llds_loss(logp, logp_old, adv, mask, self.llds_cfg,
                                                  answer_mask=batch.answer_mask[rows, :width],
                                                  valid_searches_mean=searches_mean)
            loss = loss + self.llds_cfg.lam * llds_term
            llds_value = self.llds_cfg.lam * float(llds_term.detach())
            stats.beta.append(float(llds_stats.get("beta", 1.0)))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.grad_clip)
        self.opt.step()
        with torch.no_grad():
            disp = lld.displacement(logp.detach(), logp_old, mask)
            preserved = (adv >= 0) & (mask.sum(-1) > 0)
            n_fell = ((disp.action_sum < 0) & disp.action_valid).sum(-1).float()
            stats.reduce_chunk.append(float(n_fell[preserved].mean()) if preserved.any() else float("nan"))
        stats.grad_norm.append(float(grad_norm))
        stats.clip_frac.append(pg["clip_frac"])
        stats.kl.append(pg["kl"])
        stats.pg_loss.append(pg["pg_loss"])
        stats.ppo_kl.append(pg.get("approx_kl", float("nan")))
        stats.llds_loss.append(llds_value)
        stats.entropy.append(float(entropy_mean.detach()))
        stats.loss.append(float(loss.detach()))

    def _score_after(self, batch: StepBatch) -> Tensor:
        with torch.no_grad():
            return self._logprobs(self.model, batch)[0]

    # ------------------------------------------------------------------ what a step logs
    def _payload(self, step: int, batch: StepBatch, rewards: Tensor, advantages: Tensor, scores: Scores,
                 logp_new: Tensor, updates: UpdateStats, searches_mean: float, timing: dict[str, float]) -> StepPayload:
        le = self.cfg.log
        with_tokens = le.token_every > 0 and step % le.token_every == 0 and le.token_groups != 0
        ep = batch.episodes
        payload = step_payload(
            with_tokens=with_tokens, token_ids=ep.response_ids, valid_mask=ep.response_mask, model_mask=batch.model_mask,
            answer_mask=batch.answer_mask, logp_old=scores.logp_old, logp_new=logp_new, logp_ref=scores.logp_ref,
            entropy=scores.entropy_old, advantages=advantages, rewards=rewards, group_ids=batch.group_ids,
            prompt_ids=[q.qid for _, q in batch.rows], n_searches=ep.n_searches, texts=ep.response_texts,
            question=[q.question for _, q in batch.rows], gold=[" | ".join(q.answers) for _, q in batch.rows],
        )
        payload.scalars = self._scalars(batch, rewards, advantages, scores, logp_new, updates, searches_mean, timing)
        return payload

    def _scalars(self, batch: StepBatch, rewards: Tensor, advantages: Tensor, scores: Scores, logp_new: Tensor,
                 updates: UpdateStats, searches_mean: float, timing: dict[str, float]) -> dict[str, float]:
        """The step's scalars: our signals, then the verl-named ones (`_verl_named_scalars`)."""
        mask = batch.model_mask.float()
        answer = batch.answer_mask.float()
        answer_prob = (float((torch.exp(scores.logp_old) * answer).sum() / answer.sum()) if answer.sum() > 0
                       else float("nan"))
        lr = self.opt.param_groups[0]["lr"]
        scalars = {
            "entropy": float((scores.entropy_old * mask).sum() / mask.sum().clamp(min=1)),
            "grad_norm": _mean(updates.grad_norm),
            "clip_frac": _mean(updates.clip_frac),
            "kl": _mean(updates.kl) if scores.logp_ref is not None else float("nan"),
            "pg_loss": _mean(updates.pg_loss),
            "llds_loss": _mean(updates.llds_loss),
            "answer_prob_mean": answer_prob,
            "lr": lr,
            "step_time": timing["step"],
            **self._verl_named_scalars(batch, rewards, advantages, scores, logp_new, updates, searches_mean, timing, lr),
            "lld/updates_per_step": float(len(updates.grad_norm)),
            "lld/grad_norm_max": max(updates.grad_norm) if updates.grad_norm else float("nan"),
        }
        if scores.logp_ref is not None:
            scalars["actor/kl_loss"] = scalars["kl"]
        if updates.beta:
            scalars["actor/answer_weight"] = _mean(updates.beta)
        return scalars

    @staticmethod
    def _verl_named_scalars(batch: StepBatch, rewards: Tensor, advantages: Tensor, scores: Scores, logp_new: Tensor,
                            updates: UpdateStats, searches_mean: float, timing: dict[str, float], lr: float
                            ) -> dict[str, float]:
        """The step's figures under the names verl / Search-R1 and the LLDS authors' code log them, so that the
        scalars-only detection can be judged on testbed runs (`actor/*`, `critic/*`, `env/*`, ...).
        `actor/loss_noreduce` is λ·L_LLDS averaged over the step's updates, each on its whole mini-batch (theirs
        keeps the last micro-batch's value only)."""
        ep = batch.episodes
        out = {
            **authors_scalars(model_mask=batch.model_mask, logp_old=scores.logp_old, advantages=advantages,
                              logp_ref=scores.logp_ref, answer_mask=batch.answer_mask, logp_now=logp_new),
            "actor/entropy_loss": _mean(updates.entropy),
            "actor/grad_norm": _mean(updates.grad_norm),
            "actor/ppo_kl": _mean(updates.ppo_kl),
            "actor/pg_clipfrac": _mean(updates.clip_frac),
            "actor/pg_loss": _mean(updates.pg_loss),
            "actor/loss_noreduce": _mean(updates.llds_loss),
            "actor/mean_reduce_chunk": _mean(updates.reduce_chunk),
            "actor/lr": lr,
            "critic/score/mean": float(rewards.mean()),
            "critic/advantages/mean": float(advantages.mean()),
            "env/number_of_valid_search": searches_mean,
            "env/number_of_actions/mean": float(np.mean(ep.n_actions)),
            "env/finish_ratio": float(np.mean(ep.finished)),
            "env/number_of_valid_action": float(np.mean(ep.n_valid_actions)),
            "response_length/mean": float(ep.response_mask.sum(-1).float().mean()),
            "timing_s/step": timing["step"],
            "timing_s/gen": timing["gen"],
            "timing_s/ref": timing["ref"],
            "timing_s/update_actor": timing["update_actor"],
        }
        return out

    # ------------------------------------------------------------------ the loop
    def _gather_samples(self, samples: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Rank 0: every rank's samples of this step (the step row is computed from all of them)."""
        if not self.dist.enabled:
            return None
        parts: list = [None] * self.dist.world_size
        torch_dist.all_gather_object(parts, samples)
        if self.dist.rank != 0:
            return None
        return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in samples}

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

    def _run_id(self) -> str | None:
        """The run id: given, or (several ranks) rank 0's new one, broadcast so that every rank writes one run."""
        if not self.dist.enabled or self.run_id is not None:
            return self.run_id
        holder = [new_run_id(self.run_name) if self.dist.rank == 0 else None]
        torch_dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def _logger(self) -> RunLogger:
        le = self.cfg.log
        try:
            vocab = token_texts(self.tok)
        except Exception:  # noqa: BLE001 - token texts are a nicety
            vocab = None
        return RunLogger(
            self.store, self.run_name, normalize_mode(self.cfg.mode), self.cfg.to_dict(), source="local",
            model=self.model_name, run_id=self._run_id(), rank=self.dist.rank, world_size=self.dist.world_size,
            flush_every_steps=le.flush_every_steps, flush_every_s=le.flush_every_s, token_every=le.token_every,
            token_groups=le.token_groups, vocab=vocab, detector=le.detector,
        )

    def train(self, steps: int | None = None, on_step=None) -> str:
        """Train `steps` steps (default: the config's), logging each; returns the run id. `on_step(step, payload)`
        is called after each step is logged. Ctrl-C ends the run cleanly (finished); an error marks it crashed."""
        steps = self.cfg.steps if steps is None else steps
        logger = self._logger()
        status = "finished"
        bar = tqdm(range(steps), desc=f"{self.cfg.mode} seed {self.cfg.seed}", disable=not self.progress or self.dist.rank != 0,
                   dynamic_ncols=True)
        try:
            for s in bar:
                payload = self.step(s)
                logger.log_step(s, scalars=payload.scalars if self.dist.rank == 0 else None, samples=payload.samples,
                                tokens=payload.tokens, all_samples=self._gather_samples(payload.samples))
                if self.dist.rank == 0:
                    bar.set_postfix(reward=f"{payload.scalars['critic/score/mean']:.3f}", phase=logger.phase or "-",
                                    gn=f"{payload.scalars['grad_norm']:.2f}")
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
