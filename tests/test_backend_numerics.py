"""Pinned numerics without CPU-dispatched code: `elementwise.c` instead of MKL's VML for exp/log/sqrt/sin/cos,
exact BM25 in the retriever instead of numpy's SIMD top-k, and an audit that a pinned step reaches no MKL or
oneDNN function at all (docs/backend.md, "Reproducibility")."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lld_monitor.backend import ckernels, elementwise
from lld_monitor.backend.elementwise import UnpinnedOperatorError
from lld_monitor.backend.numerics import numpy_avx512_targets
from lld_monitor.backend.retriever import BM25Retriever, _ln
from lld_monitor.backend.world import Document

ROOT = Path(__file__).resolve().parents[1]
needs_kernel = pytest.mark.skipif(not ckernels.available(), reason="pinned-numerics kernels unavailable (no AVX2/cc)")


@pytest.fixture
def pinned_math():
    elementwise.install()
    yield
    elementwise.uninstall()


def _correctly_rounded(fn, x: np.ndarray) -> np.ndarray:
    return fn(x.astype(np.float64)).astype(np.float32)


@needs_kernel
def test_float32_results_are_correctly_rounded(pinned_math):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(200_000, generator=g) * 60 - 40
    pos = torch.rand(200_000, generator=g) * 1e3 + 1e-30
    for name, arg, ref in [("exp", x, np.exp), ("log", pos, np.log), ("sin", x * 50, np.sin), ("cos", x * 50, np.cos)]:
        got = getattr(torch, name)(arg).numpy()
        want = _correctly_rounded(ref, arg.numpy())
        assert (got != want).sum() <= 2, name  # only where the exact value lies ~1e-16 from a rounding boundary
    assert np.array_equal(torch.sqrt(pos).numpy(), np.sqrt(pos.numpy()))  # IEEE sqrt, bit for bit


@needs_kernel
def test_float64_results_and_special_values(pinned_math):
    x = torch.linspace(-700, 700, 100_001, dtype=torch.float64)
    assert torch.allclose(torch.exp(x), torch.from_numpy(np.exp(x.numpy())), rtol=5e-16, atol=0)
    p = torch.exp(torch.linspace(-700, 700, 100_001, dtype=torch.float64))
    assert torch.allclose(torch.log(p), torch.from_numpy(np.log(p.numpy())), rtol=5e-16, atol=1e-300)
    inf, nan = float("inf"), float("nan")
    sp = torch.tensor([nan, inf, -inf, 0.0, -0.0, 100.0, -104.0])
    assert torch.equal(torch.exp(sp).isnan(), torch.tensor([True] + [False] * 6))
    assert torch.exp(sp)[1:].tolist() == [inf, 0.0, 1.0, 1.0, inf, 0.0]
    assert torch.log(sp)[[1, 3, 4, 5]].tolist() == [inf, -inf, -inf, float(np.float32(math.log(100)))]
    assert torch.log(sp)[[0, 2, 6]].isnan().all()
    assert torch.sqrt(sp)[[1, 3, 5]].tolist() == [inf, 0.0, 10.0] and torch.sqrt(sp)[[0, 2, 6]].isnan().all()
    assert math.copysign(1, torch.sqrt(sp)[4]) == -1 and math.copysign(1, torch.sin(sp)[4]) == -1
    assert torch.sin(sp)[:3].isnan().all() and torch.cos(sp)[:3].isnan().all()


@needs_kernel
def test_autograd_variants_and_dtypes_through_the_override(pinned_math):
    a = torch.tensor([0.5, 2.0], requires_grad=True)
    (a.exp().sum() + a.sqrt().sum() + a.log().sum() + a.sin().sum() + a.cos().sum()).backward()
    v = a.detach().double()
    want = v.exp() + 0.5 / v.sqrt() + 1 / v + v.cos() - v.sin()
    assert torch.allclose(a.grad.double(), want, rtol=1e-6)
    b = torch.tensor([1.0, 4.0])
    b.sqrt_()
    assert b.tolist() == [1.0, 2.0]
    out = torch.empty(3)
    torch.exp(torch.tensor([0.0, 1.0, 2.0]), out=out)
    assert out.tolist() == _correctly_rounded(np.exp, np.array([0.0, 1.0, 2.0])).tolist()
    assert torch.exp(torch.tensor([1, 2])).dtype == torch.float32  # integers promoted, as ATen does
    assert torch.exp(torch.tensor([1.0], dtype=torch.bfloat16)).dtype == torch.bfloat16
    x = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    assert torch.equal(torch.exp(x), torch.exp(x.contiguous()))


@needs_kernel
def test_other_vml_operators_are_refused_and_uninstall_restores_aten(pinned_math):
    with pytest.raises(UnpinnedOperatorError, match="torch.tanh is not part of pinned numerics"):
        torch.tanh(torch.tensor([1.0]))
    elementwise.uninstall()
    assert not elementwise.installed()
    assert torch.tanh(torch.tensor([1.0])).item() == pytest.approx(math.tanh(1.0))
    elementwise.install()
    assert elementwise.installed()


# ---------------------------------------------------------------------------------------------- retriever
DOCS = [
    Document("a", "velor", "velor is a city in zandia ."),
    Document("b", "tilos", "tilos is a city in zandia ."),
    Document("c", "zandia", "zandia is a country . its capital is velor ."),
    Document("d", "anna", "anna was born in tilos ."),
]


def test_bm25_score_by_hand():
    """Lucene's BM25 (bm25s's default) worked out by hand for one term of one document."""
    r = BM25Retriever(DOCS)
    lengths = [7, 7, 9, 6]  # words of title + text
    avgdl = sum(lengths) / 4
    # "zandia": df = 3 (a, b, c); in c it occurs twice (title and text)
    idf = math.log(1 + (4 - 3 + 0.5) / (3 + 0.5))
    tf, dl = 2, 9
    want = idf * tf / (tf + 1.5 * (1 - 0.75 + 0.75 * dl / avgdl))
    assert r.scores("zandia")[2] == pytest.approx(want, rel=1e-15)
    # a repeated query token counts again; unknown tokens count nothing
    assert r.scores("zandia zandia nowhere")[2] == pytest.approx(2 * want, rel=1e-15)


def test_tied_documents_rank_by_document_index():
    r = BM25Retriever(DOCS)
    hits = r.search(["city"], k=2)[0]
    assert hits[0].score == hits[1].score and [h.doc_id for h in hits] == ["a", "b"]
    # the same documents in another order: the tie goes to the other one
    hits = BM25Retriever([DOCS[1], DOCS[0], *DOCS[2:]]).search(["city"], k=2)[0]
    assert [h.doc_id for h in hits] == ["b", "a"]
    assert r.search(["nothing here"], k=3) == [[]]


def test_ln_is_log_to_a_few_units_in_the_last_place():
    rng = np.random.default_rng(0)
    for x in [*rng.uniform(1, 1e4, 20_000), 1.0, 2.0, 1e300, 5e-324, 0.7071067811865476]:
        assert abs(_ln(float(x)) - math.log(x)) <= 4 * math.ulp(math.log(x)) + 1e-320


SCORES_SCRIPT = """
import hashlib, json, sys
from lld_monitor.backend.retriever import BM25Retriever
from lld_monitor.backend.world import WorldConfig, build_world
w = build_world(WorldConfig(**json.load(open("scripts/spiral_config.json"))["world"]))
r = BM25Retriever(w.documents)
qs = [d.title for d in w.documents] + [q.question for q in w.questions[:300]]
h = hashlib.sha256()
for hits in r.search(qs, 3):
    h.update(repr([(x.doc_id, x.score.hex()) for x in hits]).encode())
print(h.hexdigest())
"""


def test_bm25_results_are_the_same_with_numpys_avx512_turned_off():
    targets = numpy_avx512_targets()
    if not targets:
        pytest.skip("this CPU has no AVX-512: numpy runs its AVX2 code already")
    out = {}
    for label, extra in (("native", {}), ("avx2", {"NPY_DISABLE_CPU_FEATURES": " ".join(targets)})):
        res = subprocess.run([sys.executable, "-c", SCORES_SCRIPT], cwd=ROOT, env={**os.environ, **extra},
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        out[label] = res.stdout.strip()
    assert out["native"] == out["avx2"]


# ---------------------------------------------------------------------------------------------- the audit
@needs_kernel
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb (Debian: apt-get install gdb)")
def test_a_pinned_step_calls_no_mkl_or_onednn_function():
    res = subprocess.run([sys.executable, "scripts/numerics_audit.py", "mkl"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert "no MKL or oneDNN call" in res.stdout and res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert json.loads(res.stdout.splitlines()[0])["root"] == str(ROOT)
