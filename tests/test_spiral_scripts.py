"""The experiment scripts on the bundled sample runs: the docs table is computed, not typed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_runs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (SAMPLES / "store.json").exists(), reason="sample_runs/ has no store")
def test_analyze_spiral_table_matches_the_stored_runs():
    from lld_monitor.detect import reward_collapse_step
    from lld_monitor.store import open_store_reader

    mod = _load("analyze_spiral")
    rows = mod.summarize(str(SAMPLES))
    with open_store_reader(SAMPLES) as r:
        runs = r.runs()
        assert len(rows) == len(runs)
        for row in rows:
            sig = r.signals(row["run_id"])
            assert row["detector_collapse_step"] == reward_collapse_step(sig)
            assert row["steps"] == len(sig)
            d = sig["delta_preserved"]
            assert row["delta_preserved_neg_share"] == pytest.approx(float((d < 0).mean()))
            assert row["reward_trough"] <= row["reward_peak"] and row["reward_trough_step"] >= row["reward_peak_step"]
    table = mod.markdown(rows).splitlines()
    assert len(table) == 2 + len(rows)
    modes = [line.split("|")[1].strip() for line in table[2:]]
    assert modes == sorted(modes, key=lambda n: (0 if n.startswith("vanilla") else 2 if "llds-ma" in n else 1, n))
    for row, line in zip(sorted(rows, key=lambda x: {"vanilla": 0, "llds": 1, "llds_ma": 2}[x["mode"]]), table[2:]):
        col = row["detector_collapse_step"]
        assert line.rstrip(" |").endswith("–" if col is None else str(col))
        # the phase column: stagnation / decay / phase III (acceleration) starts, as the detector named them
        ps = row["detector_phase_starts"]
        want = " / ".join(str(ps.get(k, "–")) for k in ("stagnation", "decay", "acceleration"))
        assert line.split("|")[-3].strip() == want
    # sample_runs' vanilla run went through phase III before its reward collapsed: the column must show it
    vanilla = next(r for r in rows if r["mode"] == "vanilla")
    assert "acceleration" in vanilla["detector_phase_starts"]


@pytest.mark.skipif(not (SAMPLES / "store.json").exists(), reason="sample_runs/ has no store")
def test_goal_table_follows_the_written_criteria():
    from lld_monitor.detect import reward_collapse_step
    from lld_monitor.store import open_store_reader

    mod = _load("analyze_spiral")
    rows = mod.summarize(str(SAMPLES))
    with open_store_reader(SAMPLES) as r:
        for row in rows:
            sig = r.signals(row["run_id"])
            rew = sig.set_index("step")["reward_mean"]
            assert row["collapse_step"] == reward_collapse_step(sig)
            assert row["reward_last20"] == pytest.approx(float(rew.iloc[-20:].mean()))
            assert row["holds"] == (row["collapse_step"] is None and row["reward_last20"] >= 0.85 * row["reward_peak"])
            if row["paper_order"]:
                assert row["reward_hold_steps"] >= mod.HOLD_STEPS
                assert row["surge_step"] < row["collapse_step"]
    table = mod.goal_markdown(rows).splitlines()
    assert len(table) == 2 + len(rows)
    counts = mod.goal(rows)
    assert counts.startswith("vanilla collapses: ") and "LLDS holds" in counts


def test_error_kind_on_hand_written_responses():
    """Each kind of mistake, written by hand for one two-hop question of the real world, lands in its kind."""
    from lld_monitor.backend.env import INVALID_MESSAGE
    from lld_monitor.backend.world import WorldConfig, build_world

    mod = _load("analyze_spiral")
    q = next(q for q in build_world(WorldConfig(n_countries=8, n_cities=24, n_orgs=40)).questions if q.hops == 2)
    (q1, a1), (q2, a2) = q.chain

    def obs(*words):
        return "<information> doc 1 : " + " ".join(words) + " . </information>"

    right = f"<search> {q1} </search> {obs(q1, 'x', a1)} <search> {q2} </search> {obs(q2, 'in', q.answers[0], 'or', 'zzz')} "
    cases = {
        "invalid action": f"<search> {q1} </answer> {INVALID_MESSAGE} <answer> zzz </answer>",
        "no search": "<answer> zzz </answer>",
        "wrong first query": f"<search> {q1}x </search> {obs('y')} <answer> zzz </answer>",
        "stopped after one search": f"<search> {q1} </search> {obs(q1, a1)} <answer> {a1} </answer>",
        "wrong second query": f"<search> {q1} </search> {obs(a1)} <search> {q2}x </search> {obs('y')} <answer> y </answer>",
        "no answer": right,
        "right searches, wrong entity of the documents": right + "<answer> zzz </answer>",
        "right searches, answer not in the documents": right + "<answer> qqq </answer>",
    }
    assert set(cases) == set(mod.ERROR_KINDS)
    for kind, text in cases.items():
        assert mod.error_kind(text, q) == kind, kind


@pytest.mark.skipif(not (SAMPLES / "store.json").exists(), reason="sample_runs/ has no store")
def test_error_rows_count_the_wrong_responses_of_each_window():
    from lld_monitor.store import open_store_reader

    mod = _load("analyze_spiral")
    rows = mod.error_rows(str(SAMPLES))
    with open_store_reader(SAMPLES) as r:
        runs = r.runs()
        assert len(rows) == len(mod.ERROR_WINDOWS) * len(runs)
        for row in rows:
            s = r.samples(runs.set_index("name").loc[row["run"], "run_id"])
            lo, hi = (int(x) for x in row["window"].split("(")[1].rstrip(")").split("-"))
            w = s[(s.step >= lo) & (s.step <= hi)]
            assert row["responses"] == len(w)
            assert row["wrong"] == pytest.approx(float((w.reward <= 0).mean()))
            assert sum(row[k] for k in mod.ERROR_KINDS) == pytest.approx(1.0)
    assert len(mod.errors_markdown(rows).splitlines()) == 2 + len(rows)


@pytest.mark.skipif(not (SAMPLES / "store.json").exists(), reason="sample_runs/ has no store")
def test_group_rows_split_each_block_by_kind_of_response():
    from lld_monitor.store import open_store_reader

    mod = _load("analyze_spiral")
    rows = mod.group_rows(str(SAMPLES), block=40)
    with open_store_reader(SAMPLES) as r:
        runs = r.runs().set_index("name")
        for row in rows:
            assert sum(row[k][0] for k in mod.GROUP_KINDS) == pytest.approx(1.0)
            s = r.samples(runs.loc[row["run"], "run_id"])
            lo = int(row["steps"].split("-")[0])
            w = s[(s.step >= lo) & (s.step < lo + 40)]
            a0c = w[(w.advantage == 0) & (w.reward > 0)]
            assert row["A0 correct"][0] == pytest.approx(len(a0c) / len(w))
            assert row["A0 correct"][1] == pytest.approx(float((a0c.logp_new_sum - a0c.logp_old_sum).mean()))
    by = {(r["mode"], r["steps"]): r for r in rows}
    # what the sample runs show (docs/backend.md), in the steps of vanilla's spiral and LLDS's dip: vanilla's updates
    # displace the all-correct groups it gives no gradient, LLDS's do not; and LLDS preserves the all-wrong groups
    # that vanilla displaces
    assert by[("vanilla", "120-159")]["A0 correct"][1] < -0.3 < by[("llds", "120-159")]["A0 correct"][1]
    assert by[("vanilla", "80-119")]["A0 wrong"][1] < 3 * by[("llds", "80-119")]["A0 wrong"][1] < 0
    assert len(mod.groups_markdown(rows).splitlines()) == 2 + len(rows)


@pytest.mark.skipif(not (SAMPLES / "store.json").exists(), reason="sample_runs/ has no store")
def test_sample_runs_timeline_reports_the_collapse_minute(capsys):
    from lld_monitor.detect import reward_collapse_step
    from lld_monitor.store import open_store_reader

    _load("make_sample_runs").timeline(SAMPLES)
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    with open_store_reader(SAMPLES) as r:
        for _, run in r.runs().iterrows():
            s = r.steps(run.run_id)
            col = reward_collapse_step(r.signals(run.run_id))
            line = lines[run["name"]]
            assert line.startswith(f"{len(s)} steps, median {s.step_time.median():.2f} s per step")
            if col is None:
                assert line.endswith("no collapse")
            else:
                minutes = float(line.split(", ")[-1].split()[0])
                assert f"collapse at step {col}," in line
                assert 0 < minutes * 60 <= s.step_time.sum() + 60


def test_probe_configs_load_and_are_listed():
    """Every probe config is a valid training config (unknown keys are an error) and is listed in its README."""
    import json

    from lld_monitor.backend.config import load_config

    probes = sorted((ROOT / "scripts" / "probes").glob("*.json"))
    readme = (ROOT / "scripts" / "probes" / "README.md").read_text()
    base = json.loads((ROOT / "scripts" / "spiral_config.json").read_text())
    assert probes
    for p in probes:
        cfg = load_config(p)
        assert f"`{p.name}`" in readme
        assert json.loads(p.read_text()) != base and cfg.steps > 0


@pytest.mark.slow
def test_probe_displacement_measures_the_step_training_takes():
    """The probe's vanilla arm is the step a vanilla run takes from the same state (restoring model, optimizer
    and schedule loses nothing), and both arms see the same rollouts."""
    from lld_monitor.backend.config import load_config
    from lld_monitor.backend.grpo import Trainer

    spec = importlib.util.spec_from_file_location("probe_displacement", ROOT / "scripts" / "probe_displacement.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = str(ROOT / "scripts" / "spiral_config.json")
    res = mod.probe(config, pre=2, probes=2, heldout=40, progress=False)
    assert res["heldout_correct"] > 0 and [r["step"] for r in res["steps"]] == [2, 3]
    tr = Trainer(load_config(config, mode="vanilla", seed=1), str(ROOT), "direct", progress=False)
    smp = [tr.step(s).samples for s in range(3)][2]
    want = mod.arm_figures(smp["logp_new_sum"] - smp["logp_old_sum"], smp["advantage"], smp["reward"])
    got = res["steps"][0]["vanilla"]
    for k, v in want.items():
        assert got[k] == v or (v != v and got[k] != got[k]), (k, got[k], v)
    for row in res["steps"]:
        assert row["vanilla"]["reward"] == row["llds"]["reward"]
        assert all(abs(row[a]["held"]) < float("inf") and 0 <= row[a]["fell"] <= 1 for a in ("vanilla", "llds"))
    assert "| mean |" in mod.summary(res)


def test_analyze_spiral_includes_stopped_runs_only_when_asked(tmp_path):
    """A run killed before its last step is skipped by default (its outcome is unknown); `--stopped`
    summarizes it, marked with its status and step count."""
    from lld_monitor.logger import RunLogger

    mod = _load("analyze_spiral")
    rng = np.random.default_rng(0)
    for name, status in (("vanilla-seed1", "finished"), ("llds-seed1", "crashed")):
        lg = RunLogger(tmp_path, name, name.split("-")[0], detector=False)
        for step in range(30):
            lg.log_step(step, {"reward_mean": 0.8 + 0.05 * rng.standard_normal(), "ll_correct_mean": -0.05,
                               "delta_preserved": 0.0, "entropy": 0.1, "grad_norm": 1.0})
        lg.close(status=status)
    assert [r["run"] for r in mod.summarize(str(tmp_path))] == ["vanilla-seed1"]
    runs = sorted(r["run"] for r in mod.summarize(str(tmp_path), stopped=True))
    assert runs == ["llds-seed1 (crashed at 30 steps)", "vanilla-seed1"]
