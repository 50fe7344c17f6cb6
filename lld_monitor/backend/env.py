"""The Search-R1 environment: action parsing and the batched multi-turn rollout.

Format (as Search-R1): the model writes `<search> query </search>`; the environment appends
`<information> ... </information>` (the retriever's top-k documents); up to `max_turns` searches,
then one last action in which a search is no longer executed; the episode ends at
`<answer> ... </answer>`. An action without a closed `<search>`/`<answer>` span (malformed tags, a
missing close tag, an overlong action) is invalid: the environment appends a corrective message, as
Search-R1 does, and the turn is spent. Everything the environment appends is a *tool* token: it
stays in the context but is masked from the loss and from every likelihood figure.

The rollout samples one action token for every unfinished row at a time (one model call over all
rows); what the environment appends after an action (an observation, the invalid-action message) goes
into the model in one more call, all of it at once, for just the rows that got it. Prompts are
left-padded, so in the returned tensors response position j is column P+j for every row.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from lld_monitor.roles import ROLE_ACTION, ROLE_TOOL

from .config import EnvConfig
from .model import decoder
from .retriever import Retriever, format_observation

log = logging.getLogger(__name__)

INVALID_MESSAGE = "invalid action . use search or answer ."
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


@dataclass(frozen=True)
class ParsedAction:
    kind: str  # "search" | "answer" | "invalid"
    content: str = ""


def parse_action(text: str) -> ParsedAction:
    """Search-R1's rule: the first closed <search>...</search> or <answer>...</answer> span wins;
    anything else (no closed span, mismatched tags, an empty search query) is invalid."""
    m = _ACTION.search(text)
    if m is None:
        return ParsedAction("invalid")
    kind, content = m.group(1), m.group(2).strip()
    if kind == "search" and not content:
        return ParsedAction("invalid")
    return ParsedAction(kind, content)


def format_prompt(question: str, cfg: EnvConfig) -> str:
    return cfg.prompt_template.format(question=question)


def observation_text(hits, cfg: EnvConfig) -> str:
    return f"<information> {format_observation(hits, cfg.max_obs_words)} </information>"


@dataclass
class Rollout:
    """A batch of finished episodes. Tensors are [N, P+T]: left-padded prompt, then the response."""

    input_ids: "object"  # LongTensor [N, P+T]
    attention_mask: "object"  # LongTensor [N, P+T]
    prompt_width: int  # P
    response_ids: "object"  # LongTensor [N, T]
    response_mask: "object"  # BoolTensor [N, T]: valid response positions
    role: "object"  # LongTensor [N, T]: 0 action, 1 tool (answer spans are marked later)
    response_texts: list[str]
    n_actions: list[int]
    n_searches: list[int]
    n_valid_actions: list[int]
    finished: list[bool]
    searched_queries: list[list[str]] = field(default_factory=list)


@dataclass
class _Row:
    tokens: list = field(default_factory=list)
    roles: list = field(default_factory=list)
    turn: list = field(default_factory=list)
    n_actions: int = 0
    n_searches: int = 0
    n_valid: int = 0
    done: bool = False
    finished: bool = False
    queries: list = field(default_factory=list)


class _StopDetector:
    """Detects the end of an action: a close tag just completed (token-id suffix match)."""

    def __init__(self, tokenizer):
        self.close_seqs = []
        for tag in ("</search>", "</answer>"):
            ids = tokenizer.encode(" " + tag, add_special_tokens=False)
            ids2 = tokenizer.encode(tag, add_special_tokens=False)
            for s in {tuple(ids), tuple(ids2)}:
                if s:
                    self.close_seqs.append(s)
        self.single = {s[0] for s in self.close_seqs if len(s) == 1}
        self.multi = [s for s in self.close_seqs if len(s) > 1]
        self.tokenizer = tokenizer

    def stopped(self, turn: list[int]) -> bool:
        if turn and turn[-1] in self.single:
            return True
        for s in self.multi:
            if len(turn) >= len(s) and tuple(turn[-len(s):]) == s:
                return True
        if self.multi:  # sub-word tokenizers may merge the tag with neighbours: check the text
            tail = self.tokenizer.decode(turn[-6:])
            return tail.rstrip().endswith("</search>") or tail.rstrip().endswith("</answer>")
        return False


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(" " + text if not text.startswith(" ") else text, add_special_tokens=False)


def rollout(model, tokenizer, prompts: Sequence[str], retriever: Retriever, cfg: EnvConfig, generator=None) -> Rollout:
    """Roll out one episode per prompt with the current policy (sampling at `cfg.temperature`)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    stop = _StopDetector(tokenizer)
    invalid_ids = _encode(tokenizer, INVALID_MESSAGE)
    enc = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    if any(len(e) == 0 for e in enc):
        raise ValueError("empty prompt")
    P = max(len(e) for e in enc)
    N = len(enc)
    prompt = torch.full((N, P), pad, dtype=torch.long)
    pmask = torch.zeros((N, P), dtype=torch.long)
    for i, e in enumerate(enc):
        prompt[i, P - len(e):] = torch.tensor(e)
        pmask[i, P - len(e):] = 1
    rows = [_Row() for _ in range(N)]
    was_training = model.training
    model.eval()
    # every response is at most max_response_tokens; a call may write that many padded columns past a row's end
    dec = decoder(model, N, P + 2 * cfg.max_response_tokens + 1)
    with torch.no_grad():
        logits = dec.start(prompt.to(device), pmask.to(device))
        while True:
            # sample for every row (cheap; finished rows' draws are dropped)
            scaled = logits.float() / max(cfg.temperature, 1e-6)
            probs = torch.softmax(scaled, dim=-1)
            if cfg.top_p < 1.0:
                sp, si = probs.sort(dim=-1, descending=True)
                keep = sp.cumsum(-1) - sp < cfg.top_p
                sp = sp * keep
                probs = torch.zeros_like(probs).scatter_(-1, si, sp)
            sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()
            forced: dict[int, list[int]] = {}  # what the environment appends after this token
            pending: list[tuple[int, str]] = []
            for i, r in enumerate(rows):
                if r.done:
                    continue
                tok = sampled[i]
                r.tokens.append(tok)
                r.roles.append(ROLE_ACTION)
                r.turn.append(tok)
                ended = stop.stopped(r.turn)
                if not ended and len(r.turn) < cfg.max_action_tokens:
                    continue
                act = parse_action(tokenizer.decode(r.turn))
                r.turn = []
                final = r.n_actions >= cfg.max_turns
                r.n_actions += 1
                if act.kind == "answer":
                    r.n_valid += 1
                    r.done = r.finished = True
                elif act.kind == "search" and not final:
                    r.n_valid += 1
                    r.n_searches += 1
                    r.queries.append(act.content)
                    pending.append((i, act.content))
                elif final:
                    r.done = True
                else:
                    forced[i] = list(invalid_ids)
            if pending:
                hits = retriever.search([q for _, q in pending], cfg.topk)
                for (i, _), h in zip(pending, hits):
                    forced[i] = _encode(tokenizer, observation_text(h, cfg))
            one, chunks = [], []  # rows that feed their sampled token alone / followed by tool tokens
            for i, r in enumerate(rows):
                if r.done:
                    continue
                tool = forced.get(i, [])[: max(0, cfg.max_response_tokens - len(r.tokens))]
                r.tokens += tool
                r.roles += [ROLE_TOOL] * len(tool)
                if len(r.tokens) >= cfg.max_response_tokens:
                    r.done = True
                elif tool:
                    chunks.append((i, [sampled[i]] + tool))
                else:
                    one.append(i)
            if all(r.done for r in rows):
                break
            if one:  # every row in one call (no gather of the cache); the others feed nothing
                counts = torch.zeros(N, dtype=torch.long, device=device)
                counts[one] = 1
                out = dec.feed(None, torch.tensor(sampled, dtype=torch.long, device=device)[:, None], counts)
                logits[one] = out[one].to(logits.dtype)
            if chunks:
                idx = torch.tensor([i for i, _ in chunks], dtype=torch.long, device=device)
                width = max(len(c) for _, c in chunks)
                toks = torch.full((len(chunks), width), pad, dtype=torch.long, device=device)
                for j, (_, c) in enumerate(chunks):
                    toks[j, : len(c)] = torch.tensor(c)
                counts = torch.tensor([len(c) for _, c in chunks], dtype=torch.long, device=device)
                logits[idx] = dec.feed(idx, toks, counts).to(logits.dtype)
    if was_training:
        model.train()
    T = max(1, max(len(r.tokens) for r in rows))
    resp = torch.full((N, T), pad, dtype=torch.long)
    rmask = torch.zeros((N, T), dtype=torch.bool)
    role = torch.full((N, T), ROLE_TOOL, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.tokens)
        if n:
            resp[i, :n] = torch.tensor(r.tokens)
            rmask[i, :n] = True
            role[i, :n] = torch.tensor(r.roles)
    input_ids = torch.cat([prompt, resp], dim=1)
    attention_mask = torch.cat([pmask, rmask.long()], dim=1)
    texts = [tokenizer.decode(r.tokens) for r in rows]
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_width=P,
        response_ids=resp,
        response_mask=rmask,
        role=role,
        response_texts=texts,
        n_actions=[r.n_actions for r in rows],
        n_searches=[r.n_searches for r in rows],
        n_valid_actions=[r.n_valid for r in rows],
        finished=[r.finished for r in rows],
        searched_queries=[r.queries for r in rows],
    )


def pack_sequences(tokenizer, prompts: Sequence[str], segments: Sequence[Sequence[tuple[str, int]]]):
    """Tokenize demonstrations into the same layout as `rollout` (for the supervised warm start).

    `segments[i]` is the response of prompt i as (text, role) pieces. Returns (input_ids,
    attention_mask, prompt_width, response_ids, response_mask, role)."""
    pad = tokenizer.pad_token_id
    enc = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    P = max(len(e) for e in enc)
    resp_tokens, resp_roles = [], []
    for segs in segments:
        toks: list[int] = []
        roles: list[int] = []
        for text, rl in segs:
            ids = _encode(tokenizer, text)
            toks += ids
            roles += [rl] * len(ids)
        resp_tokens.append(toks)
        resp_roles.append(roles)
    N = len(enc)
    T = max(1, max(len(t) for t in resp_tokens))
    prompt = torch.full((N, P), pad, dtype=torch.long)
    pmask = torch.zeros((N, P), dtype=torch.long)
    resp = torch.full((N, T), pad, dtype=torch.long)
    rmask = torch.zeros((N, T), dtype=torch.bool)
    role = torch.full((N, T), ROLE_TOOL, dtype=torch.long)
    for i, (e, toks, roles) in enumerate(zip(enc, resp_tokens, resp_roles)):
        prompt[i, P - len(e):] = torch.tensor(e)
        pmask[i, P - len(e):] = 1
        if toks:
            resp[i, : len(toks)] = torch.tensor(toks)
            rmask[i, : len(toks)] = True
            role[i, : len(toks)] = torch.tensor(roles)
    return torch.cat([prompt, resp], 1), torch.cat([pmask, rmask.long()], 1), P, resp, rmask, role
