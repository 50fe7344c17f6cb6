"""Exact-match reward after SQuAD/Search-R1 normalization."""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def extract_answer(text: str) -> str | None:
    """The content of the last closed <answer>...</answer> span, or None."""
    matches = _ANSWER.findall(text)
    return matches[-1].strip() if matches else None


def em_reward(response_text: str, golds: Iterable[str]) -> float:
    """1.0 if the last answer span matches any gold answer after normalization, else 0.0."""
    pred = extract_answer(response_text)
    if pred is None:
        return 0.0
    p = normalize_answer(pred)
    return 1.0 if any(p == normalize_answer(g) for g in golds) else 0.0
