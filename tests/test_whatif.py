"""`lld-monitor whatif` (issue 31): the LLDS counterfactual of a stored run, step by step and token by token.

- a hand-built step whose answer is written out below (A-gate, R-gate, token-mean norm, λ);
- the flags the token inspector outlines agree with llds_loss's counts and value;
- the cache: reused, extended when the run logs more, torch-free to read;
- the bundled runs: the LLDS run's counterfactual beside its logged llds_loss, the vanilla run's by phase
  (relations only: sample_runs/ is regenerated with new numbers);
- bad input: unknown run, a run without token rows, λ ≤ 0: a clear message, exit 2, nothing written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lld_monitor import lld
from lld_monitor.cli import main
from lld_monitor.counterfactual import cache as wc
from lld_monitor.counterfactual import evaluate as compute
from lld_monitor.store import RunWriter, open_store_reader

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_RUNS = ROOT / "sample_runs"

# One step, three logged samples (a tool token between the actions of samples 0 and 1):
#   sample 0, Â = +1:  action 0 = pos 0 (old −1, new −1.5: d = +0.5), pos 1 (old −2, new −1.75: d = −0.25)
#                      pos 2 tool; action 1 = answer pos 3 (old −0.5, new −0.25: d = −0.25), pos 4 (old −0.25,
#                      new −0.375: d = +0.125)
#   sample 1, Â = 0:   pos 0 (d = +0.25), pos 1 tool, pos 2 (d = +0.25)
#   sample 2, Â = −1:  pos 0, pos 1 (d = +1 each): not preserved
# A-gate: action 0 of sample 0 (Σd = 0.25 > 0) is open, its action 1 (Σd = −0.125) is not; both actions of
# sample 1 are open. Penalized: s0 pos 0 (0.5), s1 pos 0 and 2 (0.25 each).
#   norm=response:   (0.5/4 + 0.5/2) / 2 = 0.1875
#   norm=token_mean: (0.5 + 0.25 + 0.25) / (4 + 2 + 2 action tokens) = 0.125
# R-gate: sample 0's Σd = 0.125 > 0, so both its actions are open: penalized s0 pos 0 and 4 (0.625 / 4);
#   sample 1 as before: (0.15625 + 0.25) / 2 = 0.203125, 4 penalized tokens, 4 gated actions.
HAND_TOKENS = [  # sample, position, role, logp_old, logp_new
    (0, 0, "action", -1.0, -1.5), (0, 1, "action", -2.0, -1.75), (0, 2, "tool", None, None),
    (0, 3, "answer", -0.5, -0.25), (0, 4, "answer", -0.25, -0.375),
    (1, 0, "action", -1.0, -1.25), (1, 1, "tool", None, None), (1, 2, "action", -0.5, -0.75),
    (2, 0, "action", -1.0, -2.0), (2, 1, "answer", -1.0, -2.0),
]
HAND_ADV = [1.0, 0.0, -1.0]


def _write_hand_run(store: Path, name: str = "hand", steps=(0,), finish: bool = True) -> RunWriter:
    w = RunWriter.create(store, name, "vanilla")
    for s in steps:
        w.append("steps", {"step": [s], "reward_mean": [0.5]})
        w.append("samples", {"step": [s] * 3, "sample_idx": [0, 1, 2], "advantage": HAND_ADV, "reward": [1.0, 1.0, 0.0],
                             "group_id": ["g"] * 3, "n_searches": [1, 1, 0]})
        w.append("tokens", {
            "step": [s] * len(HAND_TOKENS), "sample_idx": [t[0] for t in HAND_TOKENS],
            "position": [t[1] for t in HAND_TOKENS], "token_id": list(range(len(HAND_TOKENS))),
            "role": [t[2] for t in HAND_TOKENS],
            "action_idx": [-1 if t[2] == "tool" else 0 for t in HAND_TOKENS],
            "logp_old": [np.nan if t[3] is None else t[3] for t in HAND_TOKENS],
            "logp_new": [np.nan if t[4] is None else t[4] for t in HAND_TOKENS],
        })
    if finish:
        w.finish()
    else:
        w.flush()
    return w


def _whatif_json(capsys, store: Path, *args: str) -> dict:
    assert main(["whatif", "--store", str(store), *args, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def _tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------ the hand-built step


def test_hand_built_step_action_gate(tmp_path, capsys):
    _write_hand_run(tmp_path)
    doc = _whatif_json(capsys, tmp_path, "--run", "hand", "--lam", "0.5")
    assert doc["run"] == "hand" and doc["config"]["lam"] == 0.5 and doc["config"]["gate"] == "action"
    (row,) = doc["steps"]
    assert row["step"] == 0
    assert row["llds_raw"] == pytest.approx(0.1875, abs=1e-7)
    assert row["penalty"] == pytest.approx(0.5 * 0.1875, abs=1e-7)
    assert (row["n_preserved"], row["n_gated_responses"], row["n_gated_actions"], row["n_penalized_tokens"],
            row["n_samples"]) == (2, 2, 3, 3, 3)
    # the gated tokens, and those penalized, as the token inspector outlines them
    cached = wc.read_cache(tmp_path, doc["run_id"], wc.settings(lam=0.5))
    gated = {(int(r.sample_idx), int(r.position)): bool(r.penalized) for r in cached.tokens.itertuples()}
    assert gated == {(0, 0): True, (0, 1): False, (1, 0): True, (1, 2): True}
    assert cached.path == tmp_path.resolve() / "runs" / doc["run_id"] / "derived" / cached.path.name


def test_hand_built_step_other_settings(tmp_path, capsys):
    _write_hand_run(tmp_path)
    (row,) = _whatif_json(capsys, tmp_path, "--run", "hand", "--norm", "token_mean")["steps"]
    assert row["llds_raw"] == pytest.approx(0.125, abs=1e-7) and row["penalty"] == pytest.approx(0.2 * 0.125, abs=1e-7)
    (row,) = _whatif_json(capsys, tmp_path, "--run", "hand", "--gate", "response")["steps"]
    assert row["llds_raw"] == pytest.approx(0.203125, abs=1e-7)
    assert (row["n_gated_actions"], row["n_penalized_tokens"]) == (4, 4)


def test_text_table(tmp_path, capsys):
    _write_hand_run(tmp_path)
    assert main(["whatif", "--store", str(tmp_path), "--run", "hand", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "λ 0.2, gate action, norm response" in out
    assert "3.750e-02" in out  # penalty = 0.2 · 0.1875


# ------------------------------------------------------------------ one implementation of the gates


@pytest.mark.parametrize("gate", lld.GATES)
@pytest.mark.parametrize("norm", lld.NORMS)
def test_token_flags_agree_with_llds_loss(gate, norm):
    g = torch.Generator().manual_seed(3)
    b, t = 9, 17
    lo = -torch.rand(b, t, generator=g) * 3
    ln = lo + torch.randn(b, t, generator=g) * 0.4
    m = torch.rand(b, t, generator=g) > 0.25
    adv = torch.randn(b, generator=g)
    adv[0] = 0.0
    cfg = lld.LLDSConfig(gate=gate, norm=norm)
    loss, st = lld.llds_loss(ln, lo, adv, m, cfg)
    f = lld.llds_token_flags(ln, lo, adv, m, cfg)
    assert int(f.penalized.sum()) == int(st["n_penalized_tokens"]) > 0
    assert bool((f.penalized <= f.gated).all()) and bool((f.gated <= m).all())
    assert bool(((f.penalty > 0) == f.penalized).all())
    assert not f.gated[adv < 0].any()
    n_tok = m.sum(1).clamp(min=1)
    pre = (adv >= 0) & (m.sum(1) > 0)
    per_resp = (f.penalty.sum(1) / n_tok)[pre].sum()
    value = {"response": per_resp / pre.sum(), "seq_mean": per_resp / (m.sum(1) > 0).sum(),
             "token_mean": f.penalty.sum() / m.sum()}[norm]
    assert float(value) == pytest.approx(float(loss), rel=1e-6)


def test_settings_mirror_lld_config():
    assert wc.DEFAULT_SETTINGS == dataclasses.asdict(lld.LLDSConfig())
    assert (wc.GATES, wc.NORMS, wc.BETA_RULES) == (lld.GATES, lld.NORMS, lld.BETA_RULES)
    assert wc.setting_key(wc.settings(lam=0.3)) == wc.setting_key(wc.settings())  # λ is applied on read
    assert wc.setting_key(wc.settings(gate="response")) != wc.setting_key(wc.settings())


# ------------------------------------------------------------------ the cache


def test_cache_is_reused_and_extended(tmp_path, capsys, monkeypatch):
    w = _write_hand_run(tmp_path, steps=(0,), finish=False)
    calls: list[int] = []
    real = compute.evaluate_step

    def counting(batch, cfg, n):
        calls.append(batch.step)
        return real(batch, cfg, n)

    monkeypatch.setattr(compute, "evaluate_step", counting)
    first = _whatif_json(capsys, tmp_path, "--run", "hand")
    assert calls == [0]
    assert _whatif_json(capsys, tmp_path, "--run", "hand", "--lam", "0.4")["steps"][0]["penalty"] == \
        pytest.approx(2 * first["steps"][0]["penalty"])
    assert calls == [0]  # another λ: read from the cache
    # the (live) run logs another step: only that one is computed
    for s in (3,):
        w.append("samples", {"step": [s] * 3, "sample_idx": [0, 1, 2], "advantage": HAND_ADV, "group_id": ["g"] * 3})
        w.append("tokens", {"step": [s] * 2, "sample_idx": [0, 0], "position": [0, 1], "token_id": [1, 2],
                            "role": ["action", "action"], "logp_old": [-1.0, -1.0], "logp_new": [-1.5, -1.0]})
    w.flush()
    doc = _whatif_json(capsys, tmp_path, "--run", "hand")
    assert calls == [0, 3]
    assert [r["step"] for r in doc["steps"]] == [0, 3]
    assert doc["steps"][0] == first["steps"][0]
    assert doc["steps"][1]["llds_raw"] == pytest.approx(0.5 / 2)  # one preserved response, 2 tokens, d = 0.5
    w.finish()
    # another rank's rows of step 0 arrive later (a distributed run): step 0 is computed again, with them
    w1 = RunWriter.create(tmp_path, "hand", "vanilla", run_id=w.run_id, rank=1, world_size=2)
    w1.append("samples", {"step": [0], "sample_idx": [0], "advantage": [1.0], "group_id": ["h"]})
    w1.append("tokens", {"step": [0, 0], "sample_idx": [0, 0], "position": [0, 1], "token_id": [1, 2],
                         "role": ["action", "action"], "logp_old": [-1.0, -1.0], "logp_new": [-1.25, -1.0]})
    w1.finish()
    doc = _whatif_json(capsys, tmp_path, "--run", "hand")
    assert calls == [0, 3, 0]
    assert (doc["steps"][0]["n_samples"], doc["steps"][0]["n_preserved"]) == (4, 3)
    _whatif_json(capsys, tmp_path, "--run", "hand", "--recompute")
    assert calls == [0, 3, 0, 0, 3]


def test_unwritable_run_folder_falls_back_to_user_cache(tmp_path, capsys, monkeypatch):
    _write_hand_run(tmp_path / "s")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    run_dir = next((tmp_path / "s" / "runs").iterdir())
    (run_dir / wc.DERIVED_DIR).write_text("in the way")  # mkdir fails there, even as root (unlike chmod)
    doc = _whatif_json(capsys, tmp_path / "s", "--run", "hand")
    assert doc["cache"].startswith(str(tmp_path / "xdg"))
    assert wc.read_cache(tmp_path / "s", doc["run_id"], wc.settings()).path == Path(doc["cache"])
    assert (run_dir / wc.DERIVED_DIR).read_text() == "in the way"


def test_reading_the_cache_needs_no_torch(tmp_path, capsys):
    _write_hand_run(tmp_path)
    doc = _whatif_json(capsys, tmp_path, "--run", "hand")
    code = (
        "import sys\n"
        "from lld_monitor.store import open_store_reader\n"
        "from lld_monitor.counterfactual import cache as wc\n"
        "import lld_monitor.ui.counterfactual as uw\n"
        f"r = open_store_reader({str(tmp_path)!r})\n"
        f"c = wc.read_cache({str(tmp_path)!r}, {doc['run_id']!r}, wc.settings())\n"
        f"assert c.fresh_for(wc.token_row_counts(r, {doc['run_id']!r}))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print('HEAVY', bad)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "HEAVY []" in res.stdout


# ------------------------------------------------------------------ bad input


def test_unknown_run(tmp_path, capsys):
    _write_hand_run(tmp_path)
    before = _tree_digest(tmp_path)
    assert main(["whatif", "--store", str(tmp_path), "--run", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no run with id or name 'nope'" in err and "lld-monitor runs" in err
    assert _tree_digest(tmp_path) == before


def test_run_without_tokens(tmp_path, capsys):
    w = RunWriter.create(tmp_path, "from-wandb", "vanilla", source="wandb")
    w.append("steps", {"step": [0, 1], "reward_mean": [0.5, 0.6]})
    w.finish()
    before = _tree_digest(tmp_path)
    assert main(["whatif", "--store", str(tmp_path), "--run", "from-wandb"]) == 2
    err = capsys.readouterr().err
    for needle in ("no token rows", "W&B", "logp_old", "logp_new", "RunLogger", "LLDGRPOTrainer", "verl"):
        assert needle in err, needle
    assert _tree_digest(tmp_path) == before  # nothing written


def test_run_with_tokens_but_no_logp_new(tmp_path, capsys):
    w = RunWriter.create(tmp_path, "partial", "vanilla")
    w.append("samples", {"step": [0], "sample_idx": [0], "advantage": [1.0]})
    w.append("tokens", {"step": [0, 0], "sample_idx": [0, 0], "position": [0, 1], "token_id": [1, 2],
                        "role": ["action", "action"], "logp_old": [-1.0, -1.0]})
    w.finish()
    before = _tree_digest(tmp_path)
    assert main(["whatif", "--store", str(tmp_path), "--run", "partial"]) == 2
    assert "logp_new" in capsys.readouterr().err
    assert _tree_digest(tmp_path) == before


def test_logged_sample_without_advantage_is_skipped(tmp_path, capsys):
    w = RunWriter.create(tmp_path, "noadv", "vanilla")
    w.append("samples", {"step": [0, 0], "sample_idx": [0, 1], "advantage": [1.0, None]})
    w.append("tokens", {"step": [0] * 4, "sample_idx": [0, 0, 1, 1], "position": [0, 1, 0, 1], "token_id": [1, 2, 1, 2],
                        "role": ["action"] * 4, "logp_old": [-1.0] * 4, "logp_new": [-1.5, -1.0, -3.0, -3.0]})
    w.finish()
    (row,) = _whatif_json(capsys, tmp_path, "--run", "noadv")["steps"]
    assert (row["n_samples"], row["n_samples_skipped"], row["n_preserved"]) == (1, 1, 1)
    assert row["llds_raw"] == pytest.approx(0.5 / 2)


@pytest.mark.parametrize("lam", ["0", "-0.2", "nan", "inf"])
def test_lambda_must_be_positive(tmp_path, capsys, lam):
    _write_hand_run(tmp_path)
    before = _tree_digest(tmp_path)
    assert main(["whatif", "--store", str(tmp_path), "--run", "hand", f"--lam={lam}"]) == 2
    assert "λ (--lam) must be a finite number > 0" in capsys.readouterr().err
    assert _tree_digest(tmp_path) == before


def test_not_a_store(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("hello")
    assert main(["whatif", "--store", str(f), "--run", "x"]) == 2
    assert "not an lld-monitor store" in capsys.readouterr().err
    assert f.read_text() == "hello"


# ------------------------------------------------------------------ the bundled runs (relations, not figures)


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    if not (SAMPLE_RUNS / "store.json").exists():
        pytest.skip("no sample_runs/")
    dst = tmp_path_factory.mktemp("whatif") / "store"
    shutil.copytree(SAMPLE_RUNS, dst, ignore=shutil.ignore_patterns(wc.DERIVED_DIR))
    return dst


def _run_by_mode(store: Path, mode: str) -> dict:
    r = open_store_reader(store)
    try:
        runs = r.runs()
        hit = runs[runs["mode"] == mode]
        if hit.empty:
            pytest.skip(f"sample_runs/ has no {mode} run")
        return hit.iloc[0].to_dict()
    finally:
        r.close()


def _relations_hold(store: Path, run: dict, doc: dict) -> None:
    """What must hold between the counterfactual and the run's stored samples and tokens."""
    r = open_store_reader(store)
    try:
        steps = r.token_steps(run["run_id"])
        assert [s["step"] for s in doc["steps"]] == steps
        lam = doc["config"]["lam"]
        for s in doc["steps"][:: max(1, len(steps) // 12)]:  # a dozen steps spread over the run
            tok = r.tokens(run["run_id"], s["step"])
            smp = r.samples(run["run_id"], step=s["step"])
            keys = set(zip(tok["rank"], tok["sample_idx"]))
            logged = smp[[k in keys for k in zip(smp["rank"], smp["sample_idx"])]]
            scored = tok[tok["role"] != "tool"].groupby(["rank", "sample_idx"]).size()
            n_pre = sum(1 for rk, i, a in zip(logged["rank"], logged["sample_idx"], logged["advantage"])
                        if a >= 0 and scored.get((rk, i), 0) > 0)
            assert s["n_samples"] == len(keys) and s["n_samples_skipped"] == 0
            assert s["n_preserved"] == n_pre
            assert 0 <= s["n_gated_responses"] <= s["n_preserved"]
            assert s["n_penalized_tokens"] <= int(scored.sum())
            assert s["llds_raw"] >= 0 and s["penalty"] == pytest.approx(lam * s["llds_raw"])
            assert (s["llds_raw"] > 0) == (s["n_penalized_tokens"] > 0)
    finally:
        r.close()


def test_llds_sample_run_beside_its_logged_llds_loss(sample_store, capsys):
    run = _run_by_mode(sample_store, "llds")
    llds_cfg = json.loads(run["config"]).get("llds", {})
    args = [f"--{k}={llds_cfg[k]}" for k in ("lam", "gate", "norm") if llds_cfg.get(k) is not None]
    doc = _whatif_json(capsys, sample_store, "--run", run["run_id"], *args)
    _relations_hold(sample_store, run, doc)
    cf = np.array([s["penalty"] for s in doc["steps"]])
    logged = np.array([s["logged_llds_loss"] for s in doc["steps"]], dtype="float64")
    assert np.isfinite(logged).all() and (logged >= 0).all() and (logged > 0).mean() > 0.5  # LLDS acted
    # The same term, measured differently: the logged value is λ·L averaged over the step's updates on every
    # group (each before its optimizer step, the first with no displacement yet), the counterfactual is λ·L
    # after the last update on the logged groups only. Same scale, not the same number.
    assert (cf > 0).mean() > 0.5
    ratio = np.median(cf[cf > 0]) / np.median(logged[logged > 0])
    assert 1e-2 < ratio < 1e2, ratio
    assert not np.allclose(cf, logged)


def test_vanilla_sample_run_llds_would_have_acted(sample_store, capsys):
    run = _run_by_mode(sample_store, "vanilla")
    doc = _whatif_json(capsys, sample_store, "--run", run["run_id"])
    _relations_hold(sample_store, run, doc)
    pen = {s["step"]: s["penalty"] for s in doc["steps"]}
    assert all(s["logged_llds_loss"] in (None, 0.0) for s in doc["steps"])  # vanilla: no LLDS term was applied
    assert np.mean([v > 0 for v in pen.values()]) > 0.5  # but LLDS would have acted on most steps
    healthy = [pen[s["step"]] for s in doc["steps"] if s["phase"] == "healthy"]
    later = [pen[s["step"]] for s in doc["steps"] if s["phase"] in ("decay", "acceleration", "collapse")]
    if not healthy or not later:
        pytest.skip("the vanilla sample run has no healthy steps or never reached phase II")
    assert np.median(later) > np.median(healthy)  # more to preserve once the spiral has begun


def test_dashboard_view_states(tmp_path, capsys):
    """The dashboard's view of the cache: missing, ready, stale once the run logs another step (torch-free side)."""
    from lld_monitor.ui import counterfactual as uw

    w = _write_hand_run(tmp_path, finish=False)
    cfg = wc.settings()
    with open_store_reader(tmp_path) as r:
        run = r.run("hand")
        assert uw.whatif_view(r, str(tmp_path), run, cfg).state == uw.MISSING
        _whatif_json(capsys, tmp_path, "--run", "hand")
        view = uw.whatif_view(r, str(tmp_path), run, wc.settings(lam=0.5))
        assert view.state == uw.READY and not view.needs_run
        assert view.steps["penalty"].tolist() == pytest.approx([0.5 * 0.1875])
        assert uw.token_outline(view, 0, 0) == ({0}, {0, 1})
        w.append("samples", {"step": [2], "sample_idx": [0], "advantage": [1.0]})
        w.append("tokens", {"step": [2], "sample_idx": [0], "position": [0], "token_id": [1], "role": ["action"],
                            "logp_old": [-1.0], "logp_new": [-1.0]})
        w.flush()
        view = uw.whatif_view(r, str(tmp_path), run, cfg)
        assert view.state == uw.STALE and view.needs_run and view.n_behind == 1 and len(view.steps) == 1
    w.finish()
    assert uw.trend(np.array([0.0, 2, 4, 6]), np.array([1.0, 100.0, 1.0, 0.0]), span=6).tolist() == [50.5, 1.0, 50.5, 1.0]


def test_json_contract_matches_the_readme(tmp_path, capsys):
    """Every field of the README's `whatif --json` example is in the output (fields may be added, never renamed)."""
    import re

    from lld_monitor.commands.whatif import STEP_FIELDS

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"`lld-monitor whatif --json`.*?```json\n(.*?)```", text, re.S).group(1)
    example = json.loads(block)
    _write_hand_run(tmp_path)
    doc = _whatif_json(capsys, tmp_path, "--run", "hand")
    assert set(example) <= set(doc) and set(example["config"]) <= set(doc["config"])
    assert set(example["steps"][0]) <= set(doc["steps"][0])
    assert list(doc["steps"][0])[: len(STEP_FIELDS)] == list(STEP_FIELDS)
    assert {"run", "config", "steps"} <= set(example) and set(STEP_FIELDS) <= set(example["steps"][0])
