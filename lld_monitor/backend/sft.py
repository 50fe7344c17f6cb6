"""Supervised warm start on generated demonstrations, cached by a key over everything that changes it.

From random weights the exact-match reward stays 0, so GRPO starts from a checkpoint trained for a
short while on demonstrations of the Search-R1 format with the real retriever's observations.
Some demonstrations are deliberately imperfect (a two-hop question answered after the first search
with the intermediate entity; an answer guessed without searching), so the warm-started policy has
a non-zero but improvable reward and the mistakes GRPO must learn away are the paper's: a correct
first search inside a wrong response.

The checkpoint is a normal Hugging Face model directory (config, weights, tokenizer). Lookup order:
the copy shipped in the package (`lld_monitor/backend/assets/warmstart/<key>`), then the user cache
(`$LLD_MONITOR_CACHE` or `~/.cache/lld-monitor`)/warmstart/<key>; otherwise it is trained and saved
to the user cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from tqdm import tqdm

from lld_monitor.files import exclusive_lock, user_cache_dir
from lld_monitor.roles import ROLE_ACTION, ROLE_TOOL

from . import numerics as numerics_
from .adamw import AdamW
from .config import EnvConfig, ModelConfig, SFTConfig
from .env import format_prompt, observation_text, pack_sequences
from .model import build_model
from .retriever import BM25Retriever
from .tinylm import TinyLM
from .tokenizer import build_tokenizer, load_tokenizer
from .world import World, WorldConfig, build_world

log = logging.getLogger(__name__)

# bump when this file changes what a checkpoint contains. 2: trained with TinyLM under the run's numerics
WARMSTART_VERSION = 2
ASSETS = Path(__file__).parent / "assets" / "warmstart"


# Config fields added after the first checkpoints were keyed: part of the key only when they differ from
# their default, so that every existing checkpoint (the shipped ones included) keeps its key.
LATER_FIELDS = {"world": {"unique_names": False, "single_token_names": False}}


def _key_part(section: str, values: dict) -> dict:
    later = LATER_FIELDS.get(section, {})
    return {k: v for k, v in values.items() if not (k in later and v == later[k])}


def cache_key(world: WorldConfig, model: ModelConfig, sft: SFTConfig, env: EnvConfig, numerics: str = "pinned") -> str:
    env_part = {k: v for k, v in env.to_dict().items() if k in ("topk", "max_obs_words", "prompt_template")}
    key = {
        "version": WARMSTART_VERSION,
        "world": _key_part("world", world.to_dict()),
        "model": model.to_dict(),
        "sft": sft.to_dict(),
        "env": env_part,
        "torch": ".".join(version("torch").split(".")[:2]),
    }
    if numerics != "pinned":  # a checkpoint trained with this CPU's own kernels is this CPU's only
        key["numerics"] = numerics
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def demonstrations(world: World, retriever: BM25Retriever, env: EnvConfig, cfg: SFTConfig):
    """(prompts, segments) of `cfg.n_demos` demonstrations; segments are (text, role) pieces."""
    rng = random.Random(cfg.seed + 1)
    qs = [world.questions[rng.randrange(len(world.questions))] for _ in range(cfg.n_demos)]
    entities = sorted({a for q in world.questions for a in q.answers})
    plans = []
    for q in qs:
        u = rng.random()
        if u < cfg.guess_frac:
            plans.append(("guess", q, []))
        elif q.hops == 2 and u < cfg.guess_frac + cfg.shortcut_frac:
            plans.append(("shortcut", q, [q.chain[0][0]]))
        else:
            plans.append(("full", q, [c[0] for c in q.chain]))
    queries = [qq for _, _, qs_ in plans for qq in qs_]
    hits = retriever.search(queries, env.topk) if queries else []
    it = iter(hits)
    prompts, segments = [], []
    for kind, q, qlist in plans:
        segs: list[tuple[str, int]] = []
        for qq in qlist:
            segs.append((f"<search> {qq} </search>", ROLE_ACTION))
            segs.append((observation_text(next(it), env), ROLE_TOOL))
        if kind == "guess":
            ans = rng.choice(entities)
        elif kind == "shortcut":
            ans = q.chain[0][1]
        else:
            ans = q.answers[0]
        segs.append((f"<answer> {ans} </answer>", ROLE_ACTION))
        prompts.append(format_prompt(q.question, env))
        segments.append(segs)
    return prompts, segments


def train_warmstart(world: World, model_cfg: ModelConfig, sft: SFTConfig, env: EnvConfig, out_dir: Path,
                    numerics: str = "pinned"):
    """Train the warm-start checkpoint and save it (model + tokenizer) to `out_dir`."""
    t0 = time.time()
    threads = torch.get_num_threads()
    if numerics == "pinned":
        torch.set_num_threads(1)  # the thread count changes how reductions split, and so the bits
    try:
        return _train(world, model_cfg, sft, env, out_dir, numerics, t0)
    finally:
        torch.set_num_threads(threads)


def _train(world: World, model_cfg: ModelConfig, sft: SFTConfig, env: EnvConfig, out_dir: Path, numerics: str,
           t0: float):
    torch.manual_seed(sft.seed)
    tok = build_tokenizer(world.texts())
    model = build_model(model_cfg, tok, seed=sft.seed, fixed_matmul=numerics == "pinned")
    retriever = BM25Retriever(world.documents)
    prompts, segments = demonstrations(world, retriever, env, sft)
    ids, am, P, resp, rmask, role = pack_sequences(tok, prompts, segments)
    loss_mask = (rmask & (role == ROLE_ACTION)).float()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    opt = AdamW(model.parameters(), lr=sft.lr, weight_decay=sft.weight_decay)
    g = torch.Generator().manual_seed(sft.seed)
    model.train()
    bar = tqdm(range(sft.steps), desc="warm start (SFT)", leave=False)
    for step in bar:
        opt.set_lr_factor(min(1.0, (step + 1) / max(1, sft.warmup_steps)) * max(0.05, 1 - step / max(1, sft.steps)))
        idx = torch.randint(0, ids.shape[0], (sft.batch_size,), generator=g)
        x, a, p, lm = ids[idx], am[idx], pos[idx], loss_mask[idx]
        # trim to the longest response in the batch
        width = P + int(lm.sum(0).nonzero().max().item()) + 1 if lm.sum() > 0 else ids.shape[1]
        x, a, p, lm = x[:, :width], a[:, :width], p[:, :width], lm[:, : width - P]
        # logits only where the loss is: the action tokens of the responses
        select = torch.zeros_like(x, dtype=torch.bool)
        select[:, P - 1 : width - 1] = lm.bool()
        logits = model(x, a, p, select=select)
        nll = torch.nn.functional.cross_entropy(logits, x[:, P:width][lm.bool()], reduction="sum")
        loss = nll / lm.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    log.info("warm start trained in %.1f s (final loss %.3f) -> %s", time.time() - t0, loss.item(), out_dir)
    return model, tok


def warmstart(world_cfg: WorldConfig, model_cfg: ModelConfig, sft: SFTConfig, env: EnvConfig, world: World | None = None,
              numerics: str = "pinned"):
    """Return (model, tokenizer, checkpoint_dir), training and caching the checkpoint if needed.

    The model is a `TinyLM` computing with `numerics` (backend/numerics.py); the checkpoint is a Hugging
    Face model directory either way."""
    numerics_.require(numerics)
    key = cache_key(world_cfg, model_cfg, sft, env, numerics)
    # a checkpoint trained with pinned numerics (the shipped ones) serves native runs too: loading is exact
    keys = [cache_key(world_cfg, model_cfg, sft, env), key] if numerics != "pinned" else [key]

    def load(d: Path):
        log.info("warm start: using cached checkpoint %s", d)
        return TinyLM.from_pretrained(d, fixed_matmul=numerics == "pinned"), load_tokenizer(d), d

    def cached() -> Path | None:
        for k in keys:
            for base in (ASSETS, user_cache_dir() / "warmstart"):
                d = base / k
                if (d / "config.json").is_file() and (d / "tokenizer.json").is_file():
                    return d
        return None

    if (d := cached()) is not None:
        return load(d)
    final = user_cache_dir() / "warmstart" / key
    final.parent.mkdir(parents=True, exist_ok=True)
    # Trainers launched together on a new setting (a seeds x modes experiment) would each train the
    # same checkpoint; an exclusive lock makes the first one train it and the others wait and load it.
    with exclusive_lock(final.parent / f".{key}.lock"):
        if (d := cached()) is None:
            _train_into_cache(world or build_world(world_cfg), model_cfg, sft, env, key, final, numerics)
            d = final
    return load(d)


def _train_into_cache(world: World, model_cfg: ModelConfig, sft: SFTConfig, env: EnvConfig, key: str, final: Path,
                      numerics: str):
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    log.info("warm start: no cached checkpoint for key %s; training one (once)", key)
    try:
        train_warmstart(world, model_cfg, sft, env, tmp, numerics)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first
            if not (final / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
