"""The policy: the built-in small Qwen2-architecture model (`tinylm.TinyLM`), or any local HF causal LM.

Both are driven through the same two calls: `forward_logprobs` (ln π and entropy of response tokens, one
forward) and `decoder` (incremental decoding for the rollout). TinyLM has its own fast implementations;
a Hugging Face model goes through `HFDecoder` and its usual forward.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from lld_monitor import lld

from .config import ModelConfig
from .tinylm import TinyLM, TinyLMShape

log = logging.getLogger(__name__)


def build_model(cfg: ModelConfig, tokenizer, seed: int = 0, fixed_matmul: bool = False):
    """A freshly initialised TinyLM of this shape for `tokenizer`'s vocabulary."""
    shape = TinyLMShape(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size, max_positions=cfg.max_positions,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = TinyLM(shape, fixed_matmul=fixed_matmul)
    model.init_weights(seed)
    return model


def load_model(path: str | Path, device: str = "cpu"):
    """Load a local Hugging Face causal LM and its tokenizer (nothing is downloaded)."""
    # here, not at the top: transformers takes ~2 s to import, and only a --model PATH run needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True)
    return model.to(device), tok


def n_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _unwrap(model):
    return getattr(model, "module", model)  # DDP keeps the model in .module


def forward_logprobs(model, input_ids, attention_mask, prompt_width: int, temperature: float, action_mask=None):
    """ln π and entropy of every response token ([N, T] each) in one forward of `model` (or its DDP wrapper).

    With `action_mask` ([N, T] bool), TinyLM computes logits at those tokens only (the other entries are 0:
    every figure the trainer takes from them is masked to action tokens), and runs rows of similar length
    together (`length_buckets`) so that little is spent on padding; a row's values do not depend on the
    rows it is batched with.
    """
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    targets = input_ids[:, prompt_width:]
    if not isinstance(_unwrap(model), TinyLM):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
        return lld.logprobs_and_entropy(logits[:, prompt_width - 1 : -1, :], targets, temperature)
    if action_mask is None:
        logits = model(input_ids, attention_mask, pos)
        return lld.logprobs_and_entropy(logits[:, prompt_width - 1 : -1, :], targets, temperature)
    lengths = attention_mask[:, prompt_width:].sum(-1).tolist()
    order, parts_lp, parts_ent = [], [], []
    for rows in length_buckets(lengths):
        width = prompt_width + max(1, max(lengths[i] for i in rows))
        idx = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
        act = action_mask[idx, : width - prompt_width]
        select = torch.zeros((len(rows), width), dtype=torch.bool, device=input_ids.device)
        select[:, prompt_width - 1 : -1] = act
        logits = model(input_ids[idx, :width], attention_mask[idx, :width], pos[idx, :width], select=select)
        lp, ent = lld.logprobs_and_entropy(logits.unsqueeze(0), targets[idx, : width - prompt_width][act].unsqueeze(0),
                                           temperature)
        zeros = torch.zeros((len(rows), targets.shape[1]), dtype=lp.dtype, device=lp.device)
        parts_lp.append(zeros.masked_scatter(_pad_to(act, targets.shape[1]), lp[0]))
        parts_ent.append(zeros.masked_scatter(_pad_to(act, targets.shape[1]), ent[0]))
        order += rows
    inverse = torch.empty(len(order), dtype=torch.long, device=input_ids.device)
    inverse[torch.tensor(order, device=input_ids.device)] = torch.arange(len(order), device=input_ids.device)
    return torch.cat(parts_lp)[inverse], torch.cat(parts_ent)[inverse]


def _pad_to(mask, width: int):
    return F.pad(mask, (0, width - mask.shape[1]))


def length_buckets(lengths: list[int], min_rows: int = 8, keep: float = 0.8) -> list[list[int]]:
    """Row indices grouped by length, longest first: a group closes when the next row is shorter than
    `keep` x the group's longest and the group has `min_rows` rows (fewer calls than rows, little padding)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) < min_rows or lengths[i] >= keep * lengths[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class HFDecoder:
    """`KVDecoder`'s two calls for a Hugging Face causal LM, on its own cache: every call appends the same
    number of columns to every row, and the columns a row does not use are masked out."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.mask = None
        self.n_real = None

    def _run(self, tokens, mask_new, positions):
        self.mask = mask_new if self.mask is None else torch.cat([self.mask, mask_new], dim=1)
        out = self.model(input_ids=tokens, attention_mask=self.mask, position_ids=positions, cache=self.cache,
                         use_cache=True)
        self.cache = out.cache
        return out.logits

    def start(self, input_ids, attention_mask):
        with torch.no_grad():
            mask = attention_mask.long()
            self.n_real = mask.sum(-1)
            return self._run(input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))[:, -1]

    def feed(self, rows, tokens, counts):
        with torch.no_grad():
            n_all = self.mask.shape[0]
            idx = torch.arange(n_all) if rows is None else rows
            full = torch.full((n_all, tokens.shape[1]), int(tokens[0, 0]), dtype=tokens.dtype)
            full[idx] = tokens
            cnt = torch.zeros(n_all, dtype=torch.long)
            cnt[idx] = counts
            real = (torch.arange(tokens.shape[1])[None, :] < cnt[:, None]).long()
            positions = (self.n_real[:, None] + real.cumsum(-1) - 1).clamp(min=0)
            logits = self._run(full, real, positions)
            self.n_real = self.n_real + cnt
            return logits[torch.arange(n_all), (cnt - 1).clamp(min=0)][idx]


def decoder(model, batch: int, max_len: int):
    """The rollout's incremental decoder for `model`: TinyLM's preallocated cache, or HF's."""
    m = _unwrap(model)
    return m.decoder(batch, max_len) if hasattr(m, "decoder") else HFDecoder(m)
