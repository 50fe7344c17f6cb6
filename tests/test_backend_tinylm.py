"""TinyLM (the built-in policy's own forward) against transformers' Qwen2ForCausalLM, its incremental decoder
against its full forward, and the fixed-order matmul kernel's promises: the same bits on the AVX2 and the
AVX-512 kernel, for a row alone or in any batch, and gradients that agree with torch's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lld_monitor.backend import matmul as fixed
from lld_monitor.backend.model import forward_logprobs
from lld_monitor.backend.tinylm import TinyLM, TinyLMShape

ROOT = Path(__file__).resolve().parents[1]
SHAPE = TinyLMShape(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                    max_positions=256, pad_token_id=0, eos_token_id=2)

needs_kernel = pytest.mark.skipif(not fixed.available(), reason="fixed-order matmul kernel unavailable (no AVX2/cc)")


def _model(fixed_matmul: bool, seed: int = 0) -> TinyLM:
    m = TinyLM(SHAPE, fixed_matmul=fixed_matmul)
    m.init_weights(seed)
    with torch.no_grad():  # non-trivial norms and biases, so the comparison covers them
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in m.named_parameters():
            if name.endswith(("ln1", "ln2", "_b")) or name == "norm":
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return m.eval()


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE.vocab_size, (5, 23), generator=g)
    am = torch.ones_like(ids)
    am[0, :4] = 0  # left padding (prompts)
    am[2, :7] = 0
    am[3, 19:] = 0  # right padding (a short response)
    return ids, am, (am.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("fixed_matmul", [False, pytest.param(True, marks=needs_kernel)], ids=["native", "pinned"])
def test_logits_match_transformers_qwen2_on_the_same_weights(tmp_path, fixed_matmul):
    from transformers import Qwen2ForCausalLM

    m = _model(fixed_matmul)
    m.save_pretrained(tmp_path)  # a Hugging Face model directory
    hf = Qwen2ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, am, pos = _batch()
    with torch.no_grad():
        ours = m(ids, am, pos)
        theirs = hf(input_ids=ids, attention_mask=am, position_ids=pos).logits
        again = TinyLM.from_pretrained(tmp_path, fixed_matmul=fixed_matmul)(ids, am, pos)
    real = am.bool()
    assert (ours - theirs)[real].abs().max() < 1e-4
    assert torch.equal(ours, again)  # save -> load is exact


def test_a_qwen2_variant_tinylm_does_not_compute_is_refused(tmp_path):
    import json

    m = _model(False)
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        TinyLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("fixed_matmul", [False, pytest.param(True, marks=needs_kernel)], ids=["native", "pinned"])
def test_incremental_decoding_gives_the_full_forwards_logits(fixed_matmul):
    """Prompts, then single tokens to every row (some rows feeding nothing) and chunks of several tokens to a
    few rows, as the rollout does: each returned logit row equals the full forward's at that token."""
    m = _model(fixed_matmul)
    g = torch.Generator().manual_seed(3)
    n, p = 4, 6
    prompt = torch.randint(3, SHAPE.vocab_size, (n, p), generator=g)
    pmask = torch.ones_like(prompt)
    pmask[1, :3] = 0
    seqs = [prompt[i][pmask[i].bool()].tolist() for i in range(n)]
    got: list[tuple[int, int, torch.Tensor]] = []  # (row, index of the token the logits follow, logits)
    dec = m.decoder(n, 120)
    with torch.no_grad():
        out = dec.start(prompt, pmask)
        got += [(i, len(seqs[i]) - 1, out[i]) for i in range(n)]
        for it in range(9):
            if it % 3 == 2:
                rows, lens = [1, 3], [5, 2 + it // 3]
                toks = torch.zeros(2, max(lens), dtype=torch.long)
                for j, (r, k) in enumerate(zip(rows, lens)):
                    toks[j, :k] = torch.randint(3, SHAPE.vocab_size, (k,), generator=g)
                    seqs[r] += toks[j, :k].tolist()
                out = dec.feed(torch.tensor(rows), toks, torch.tensor(lens))
                got += [(r, len(seqs[r]) - 1, out[j]) for j, r in enumerate(rows)]
            else:
                toks = torch.randint(3, SHAPE.vocab_size, (n, 1), generator=g)
                counts = torch.tensor([1, 1, it % 2, 1])
                out = dec.feed(None, toks, counts)
                for i in range(n):
                    if counts[i]:
                        seqs[i].append(int(toks[i, 0]))
                        got.append((i, len(seqs[i]) - 1, out[i]))
        full = []
        for s in seqs:
            ids = torch.tensor(s)[None]
            full.append(m(ids, torch.ones_like(ids), torch.arange(len(s))[None])[0])
    for row, at, logits in got:
        if fixed_matmul:  # pinned: the same bits
            assert torch.equal(logits, full[row][at]), (row, at)
        else:
            assert torch.allclose(logits, full[row][at], atol=1e-5), (row, at)


@needs_kernel
def test_a_rows_logprobs_do_not_depend_on_its_batch():
    """forward_logprobs groups rows by length; a row's ln π is the same bits alone, grouped or in one batch,
    so the first update of a step sees exactly the rollout policy's ln π (Δ = 0 before any update)."""
    m = _model(True)
    ids, am, _ = _batch(1)
    prompt = 8
    am[:, :prompt] = 1
    act = torch.rand(ids.shape[0], ids.shape[1] - prompt, generator=torch.Generator().manual_seed(2)) < 0.5
    act &= am[:, prompt:].bool()
    with torch.no_grad():
        batch, _ = forward_logprobs(m, ids, am, prompt, 1.0, act)
        alone = torch.cat([forward_logprobs(m, ids[i:i + 1], am[i:i + 1], prompt, 1.0, act[i:i + 1])[0]
                           for i in range(ids.shape[0])])
        first_two = forward_logprobs(m, ids[:2], am[:2], prompt, 1.0, act[:2])[0]
    assert torch.equal(batch[act], alone[act])
    assert torch.equal(batch[:2][act[:2]], first_two[act[:2]])


@needs_kernel
def test_fixed_matmul_gradients_agree_with_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 29, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(19, 29, generator=g))
    b = torch.randn(19, generator=g, requires_grad=True)
    q = torch.randn(3, 11, 8, generator=g, requires_grad=True)
    k = torch.randn(3, 8, 13, generator=g, requires_grad=True)
    ours = (fixed.linear(x, w, b) ** 2).sum() + (fixed.matmul(q, k) ** 2).sum()
    ours.backward()
    mine = [t.grad.clone() for t in (x, w, b, q, k)]
    for t in (x, w, b, q, k):
        t.grad = None
    ((torch.nn.functional.linear(x, w, b) ** 2).sum() + (torch.matmul(q, k) ** 2).sum()).backward()
    for a, t in zip(mine, (x, w, b, q, k)):
        assert torch.allclose(a, t.grad, rtol=1e-4, atol=1e-4)
    # a weight changed in place is packed again (the cache follows the parameter's version)
    with torch.no_grad():
        before = fixed.linear(x, w)
        w.mul_(2)
        assert torch.allclose(fixed.linear(x, w), 2 * before)


ISA_SCRIPT = """
import sys, torch
from lld_monitor.backend import matmul as fixed
g = torch.Generator().manual_seed(0)
out = {}
for m, k, n in [(1, 5, 3), (7, 33, 17), (37, 128, 256), (101, 64, 554), (8, 16, 32)]:
    a = torch.randn(m, k, generator=g); w = torch.nn.Parameter(torch.randn(n, k, generator=g))
    with torch.no_grad():
        out[(m, k, n)] = (fixed.linear(a, w), fixed.raw_matmul(a, w.t()))
out["bmm"] = fixed.raw_matmul(torch.randn(4, 9, 32, generator=g), torch.randn(4, 32, 40, generator=g))
torch.save(out, sys.argv[1])
print(fixed.isa())
"""


@needs_kernel
def test_avx512_and_avx2_kernels_give_the_same_bits(tmp_path):
    """Where the CPU has AVX-512 the kernel computes 32 columns at a time instead of 16, each element by the
    same chain of fused multiply-adds: the bits must not change (what makes them the same on every CPU)."""
    runs = {}
    for isa in ("auto", "avx2"):
        env = {**__import__("os").environ, **({"LLD_MATMUL_ISA": "avx2"} if isa == "avx2" else {})}
        res = subprocess.run([sys.executable, "-c", ISA_SCRIPT, str(tmp_path / f"{isa}.pt")], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        runs[isa] = (res.stdout.strip(), torch.load(tmp_path / f"{isa}.pt"))
    assert runs["avx2"][0] == "avx2"
    if runs["auto"][0] != "avx512":
        pytest.skip("this CPU has no AVX-512: only one kernel to run")
    for key, value in runs["auto"][1].items():
        other = runs["avx2"][1][key]
        pair = value if isinstance(value, tuple) else (value,)
        pair2 = other if isinstance(other, tuple) else (other,)
        for a, b in zip(pair, pair2):
            assert torch.equal(a, b), key
        if isinstance(value, tuple):
            assert torch.equal(value[0], value[1]), key  # packed once and reused == packed per call


def test_adamw_is_torchs_single_tensor_adamw_bit_for_bit():
    """The trainer's AdamW (no torch.optim: its first call imports torch._dynamo, ≈ 2 s of start-up) makes
    the same update as torch.optim.AdamW(foreach=False), with weight decay and two parameter groups."""
    from lld_monitor.backend.adamw import AdamW

    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    o1 = AdamW([{"params": [ours[0]]}, {"params": [ours[1]], "lr": 3e-3}], lr=1e-2, weight_decay=0.1)
    o2 = torch.optim.AdamW([{"params": [theirs[0]]}, {"params": [theirs[1]], "lr": 3e-3}], lr=1e-2, weight_decay=0.1,
                           foreach=False)
    for _ in range(6):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        o1.step()
        o2.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    o1.set_lr_factor(0.5)
    assert [grp["lr"] for grp in o1.param_groups] == [5e-3, 1.5e-3]


@pytest.mark.slow
def test_the_trainer_starts_without_transformers_or_dynamo(tmp_path):
    """Start-up is mostly imports: the built-in model, tokenizer and optimizer must not pull in transformers
    (≈ 1.5 s) or torch._dynamo (≈ 2 s, what torch.optim imports on its first call)."""
    code = ("import sys; from lld_monitor.cli import main; "
            f"rc = main(['train', '--steps', '1', '--store', {str(tmp_path)!r}, '--no-progress']); "
            "print(rc, 'transformers' in sys.modules, 'torch._dynamo' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.stdout.split()[-3:] == ["0", "False", "False"], res.stdout + res.stderr[-2000:]
