"""The search tool: a small retriever interface with three implementations.

- `BM25Retriever`: BM25 over a list of documents, e.g. the generated world or a user's JSONL corpus
  (`load_jsonl_corpus`), with scores and ranking that are the same bits on every machine.
- `HTTPRetriever`: a client for a Search-R1 style server (`POST /retrieve` with
  `{"queries": [...], "topk": k, "return_scores": true}` answering `{"result": [[{"document":
  {"contents": ...}, "score": ...}, ...], ...]}`).

All return, per query, a list of `Hit(doc_id, title, text, score)`, best first.
"""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

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


def _ln(x: float) -> float:
    """ln x for x > 0 by a fixed sequence of float64 operations (no libm): the same bits on every machine.

    x = m 2^e with m in [0.707, 1.414]; ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172, by its series
    to s^23 (the next term is below 1e-19 of the result)."""
    m, e = math.frexp(x)  # exact: x = m 2^e, m in [0.5, 1)
    if m < 0.7071067811865476:
        m, e = m * 2.0, e - 1
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    q = 1.0 / 23.0
    for k in range(21, 1, -2):
        q = q * z + 1.0 / k
    return e * 6.93147180369123816490e-01 + (e * 1.90821492927058770002e-10 + (2.0 * s + 2.0 * s * (z * q)))


class BM25Retriever:
    """BM25 over in-memory documents, ranked by a total order. Empty or unmatched queries return no hits.

    The scoring is bm25s's default (Lucene's): idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)) and a term's weight
    in a document idf · tf / (tf + k1 (1 - b + b · dl / avgdl)), k1 = 1.5, b = 0.75; a query scores the sum of
    its tokens' weights (a repeated token counts again). Every score is a fixed sequence of float64 operations
    on integer counts (`_ln` has no libm), summed in the query's token order, so it has the same bits on every
    machine; hits are ranked by score, then by document index. In the generated worlds most queries tie inside
    their top 3, so the tie-break decides which documents a search returns: bm25s left that order to numpy's
    top-k selection, whose SIMD code depends on the CPU.
    """

    K1 = 1.5
    B = 0.75

    def __init__(self, documents: Sequence[Document]):
        if not documents:
            raise ValueError("BM25Retriever needs at least one document")
        self.documents = list(documents)
        n = len(self.documents)
        self._vocab: dict[str, int] = {}
        docs_of: list[list[int]] = []
        tf_of: list[list[int]] = []
        lengths = np.zeros(n, dtype=np.float64)
        for i, d in enumerate(self.documents):
            toks = bm25_tokenize(f"{d.title} {d.text}")
            lengths[i] = len(toks)
            for term, tf in Counter(toks).items():
                tid = self._vocab.setdefault(term, len(docs_of))
                if tid == len(docs_of):
                    docs_of.append([])
                    tf_of.append([])
                docs_of[tid].append(i)
                tf_of[tid].append(tf)
        avgdl = float(lengths.sum()) / n  # a sum of integers: exact
        norm = self.K1 * ((1.0 - self.B) + self.B * (lengths / avgdl))
        self._docs = [np.asarray(ds, dtype=np.int64) for ds in docs_of]
        self._weights = []
        for ds, tfs in zip(self._docs, tf_of):
            df = len(ds)
            idf = _ln(1.0 + (n - df + 0.5) / (df + 0.5))
            tf = np.asarray(tfs, dtype=np.float64)
            self._weights.append(idf * (tf / (tf + norm[ds])))

    def scores(self, query: str) -> np.ndarray:
        """Every document's BM25 score for `query` (float64, document order)."""
        out = np.zeros(len(self.documents), dtype=np.float64)
        for term in bm25_tokenize(query):
            tid = self._vocab.get(term)
            if tid is not None:
                out[self._docs[tid]] += self._weights[tid]  # a document occurs once per term: elementwise adds
        return out

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        k_eff = max(1, min(int(k), len(self.documents)))
        out: list[list[Hit]] = []
        for q in queries:
            s = self.scores(q)
            hit = np.flatnonzero(s > 0.0)
            best = hit[np.lexsort((hit, -s[hit]))[:k_eff]]  # score descending, then document index
            out.append([Hit(self.documents[i].doc_id, self.documents[i].title, self.documents[i].text, float(s[i]))
                        for i in best])
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
