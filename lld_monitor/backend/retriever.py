"""The search tool: a small retriever interface with three implementations.

- `BM25Retriever`: BM25 (the `bm25s` package) over a list of documents, e.g. the generated world
  or a user's JSONL corpus (`load_jsonl_corpus`).
- `HTTPRetriever`: a client for a Search-R1 style server (`POST /retrieve` with
  `{"queries": [...], "topk": k, "return_scores": true}` answering `{"result": [[{"document":
  {"contents": ...}, "score": ...}, ...], ...]}`).

All return, per query, a list of `Hit(doc_id, title, text, score)`, best first.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from .world import Document

log = logging.getLogger(__name__)

_WORD = re.compile(r"\w+", re.UNICODE)


def bm25_tokenize(text: str) -> list[str]:
    """Lower-case word tokens (single characters kept; no stemming, no stop words)."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Hit:
    doc_id: str
    title: str
    text: str
    score: float


class Retriever(Protocol):
    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]: ...


class BM25Retriever:
    """BM25 over in-memory documents. Empty or unmatched queries return no hits."""

    def __init__(self, documents: Sequence[Document]):
        import bm25s

        if not documents:
            raise ValueError("BM25Retriever needs at least one document")
        self.documents = list(documents)
        self._bm25 = bm25s.BM25()
        corpus = [bm25_tokenize(f"{d.title} {d.text}") or ["__empty__"] for d in self.documents]
        self._bm25.index(corpus, show_progress=False)

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        k_eff = max(1, min(int(k), len(self.documents)))
        toks = [bm25_tokenize(q) for q in queries]
        idx, scores = self._bm25.retrieve(toks, k=k_eff, show_progress=False, n_threads=1)
        out: list[list[Hit]] = []
        for row_i, row_s in zip(idx, scores):
            hits = []
            for i, s in zip(row_i, row_s):
                if float(s) <= 0.0:
                    continue
                d = self.documents[int(i)]
                hits.append(Hit(d.doc_id, d.title, d.text, float(s)))
            out.append(hits)
        return out


def load_jsonl_corpus(path: str | Path) -> list[Document]:
    """Read a JSONL corpus: one object per line with `contents` (Search-R1/FlashRAG style, where the
    first line of `contents` is the title) or `text` (+ optional `title`), and optional `id`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"corpus file not found: {p} (expected JSONL with a 'contents' or 'text' field)")
    docs: list[Document] = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not valid JSON ({e.msg}); each line must be one JSON object") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{p}:{n}: expected a JSON object, got {type(obj).__name__}")
            if "contents" in obj:
                contents = str(obj["contents"])
                title, _, body = contents.partition("\n")
                title = str(obj.get("title", title.strip('"')))
                text = body if body else contents
            elif "text" in obj:
                text = str(obj["text"])
                title = str(obj.get("title", ""))
            else:
                raise ValueError(f"{p}:{n}: object has neither 'contents' nor 'text'")
            docs.append(Document(str(obj.get("id", n - 1)), title, text))
    if not docs:
        raise ValueError(f"{p}: corpus is empty")
    return docs


class HTTPRetriever:
    """Client for a Search-R1 `/retrieve` server (e.g. `http://127.0.0.1:8000/retrieve`)."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url
        self.timeout_s = timeout_s

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        body = json.dumps({"queries": list(queries), "topk": int(k), "return_scores": True}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = json.loads(resp.read().decode("utf-8"))
        except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as e:
            raise RuntimeError(f"retriever at {self.url} failed: {e}; is the server running?") from e
        results = payload.get("result")
        if not isinstance(results, list) or len(results) != len(queries):
            raise RuntimeError(f"retriever at {self.url} answered an unexpected shape (no 'result' list per query)")
        out: list[list[Hit]] = []
        for row in results:
            hits = []
            for j, item in enumerate(row):
                if isinstance(item, dict) and "document" in item:
                    doc, score = item["document"], float(item.get("score", 0.0))
                else:
                    doc, score = item, 0.0
                contents = str(doc.get("contents", doc.get("text", "")))
                title, _, text = contents.partition("\n")
                hits.append(Hit(str(doc.get("id", j)), title.strip('"'), text or contents, score))
            out.append(hits)
        return out


def format_observation(hits: Sequence[Hit], max_words: int | None = None) -> str:
    """The text between <information> and </information> (Search-R1 style 'Doc i(Title: t) text')."""
    if not hits:
        return "no results ."
    parts = []
    for i, h in enumerate(hits, 1):
        parts.append(f"doc {i} : {h.text}")
    text = " ".join(parts)
    if max_words is not None:
        words = text.split()
        if len(words) > max_words:
            text = " ".join(words[:max_words])
    return text
