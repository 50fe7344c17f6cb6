"""Offline W&B import on runs written by the real wandb SDK (WANDB_MODE=offline, no key, no network).

The runs are written in a subprocess (this file run as a script) so the SDK's service process and
environment never leak into the test process. Every value the writer logged must come back from the
store unchanged (NaN and +/-inf included), mapped keys must land in `steps`, the mode must be inferred
from the config, re-importing must not duplicate, and damaged / still-being-written files must import
what they hold.
"""

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

# ------------------------------------------------------------------------------------- what is logged

VERL_KEYS = [
    "critic/score/mean",
    "actor/grad_norm",
    "actor/entropy_loss",
    "actor/pg_clipfrac",
    "actor/kl_loss",
    "actor/pg_loss",
    "actor/loss_noreduce",
    "actor/mean_reduce_chunk",
    "actor/pos_avg_old_log_prob",
    "actor/lr",
    "env/number_of_valid_search",
    "response_length/mean",
    "timing_s/step",
]
TRL_KEYS = [
    "train/reward",
    "train/reward_std",
    "train/loss",
    "train/grad_norm",
    "train/learning_rate",
    "train/entropy",
    "train/clip_ratio/region_mean",
    "train/completions/mean_length",
    "train/step_time",
]


def value(key: str, step: int) -> float:
    """Deterministic value with NaN / inf sprinkled in."""
    if key == "critic/score/mean" and step == 3:
        return float("nan")
    if key == "actor/grad_norm" and step == 4:
        return float("inf")
    if key == "actor/pg_loss" and step == 5:
        return float("-inf")
    if key == "train/grad_norm" and step == 2:
        return float("nan")
    h = sum(ord(c) * (i + 1) for i, c in enumerate(key))
    return round(math.sin(h * 0.001 + step * 0.37) * 10 ** (h % 4 - 2), 9)


RUNS = {
    # name: (config, key set, steps)
    "verl_llds": (
        {"actor_rollout_ref": {"actor": {"no_reduce_lambda": 0.2, "mask_answer": False}},
         "algorithm": {"adv_estimator": "grpo"}},
        VERL_KEYS, list(range(12)),
    ),
    "verl_llds_ma": (
        {"actor_rollout_ref": {"actor": {"no_reduce_lambda": 0.3, "mask_answer": True, "answer_no_reduce_lambda": 0.1}}},
        VERL_KEYS + ["actor/is_answer_mask", "actor/lowest_prob_avg_mean"], list(range(6)),
    ),
    "verl_vanilla": (
        {"actor_rollout_ref": {"actor": {"no_reduce_lambda": 0.0}}, "trainer": {"total_epochs": 15}},
        VERL_KEYS, list(range(6)),
    ),
    "trl_plain": ({"num_generations": 4, "beta": 0.0, "loss_type": "grpo", "learning_rate": 1e-6}, TRL_KEYS, [1, 2, 3, 4, 5]),
    "nocfg": ({}, ["custom/a", "custom/b"], list(range(4))),
}
MID_RUN_KEY = "val/test_score/nq"  # appears from step 6 on in verl_llds
RESUMED_ID = "resum3d"
RESUMED_STEPS = ([0, 1, 2, 3], [10, 11, 12])  # second segment after a resume: a gap of 6 steps
NOSTEP_ID = "nostep1"
TRL_RESUMED_ID = "trlres1"


def expected_rows(name: str) -> dict[int, dict[str, float]]:
    cfg, keys, steps = RUNS[name]
    out: dict[int, dict[str, float]] = {}
    for s in steps:
        row = {k: value(k, s) for k in keys}
        if name == "verl_llds" and s >= 6:
            row[MID_RUN_KEY] = value(MID_RUN_KEY, s)
        if name == "verl_llds_ma":
            row["actor/is_answer_mask"] = 0.0 if s == 0 else 0.8
        if name == "trl_plain":
            row["train/global_step"] = float(s)
            row["train/extra_same_step"] = value("train/extra_same_step", s)  # logged in a second call
            if s == 4:
                row["custom/direct"] = 7.0  # a plain wandb.log without train/global_step: belongs to step 4
        out[s] = row
    return out


def expected_resumed() -> dict[int, dict[str, float]]:
    out = {}
    for seg, steps in enumerate(RESUMED_STEPS):
        for s in steps:
            out[s] = {"actor/grad_norm": value("actor/grad_norm", s), "critic/score/mean": value("critic/score/mean", s)}
            if seg == 1:
                out[s]["actor/new_after_resume"] = float(s)
    return out


def write_runs(root: str) -> None:
    """Run by the subprocess: writes the runs above with the real SDK in offline mode."""
    import wandb

    for name, (cfg, keys, steps) in RUNS.items():
        run = wandb.init(project="lldtest", name=name, config=cfg, id=f"id-{name.replace('_', '-')}")
        rows = expected_rows(name)
        for s in steps:
            row = dict(rows[s])
            if name == "trl_plain":
                extra = {"train/extra_same_step": row.pop("train/extra_same_step"), "train/global_step": s}
                direct = row.pop("custom/direct", None)
                row["train/global_step"] = s
                run.log(row)  # like transformers' WandbCallback: no explicit step, global_step in the row
                run.log(extra)
                if s == 3:
                    run.log({"train/text_value": "not a number", "train/global_step": s})
                if direct is not None:
                    run.log({"custom/direct": direct})
            else:
                run.log(row, step=s)
        run.finish()
    # resumed without step= (TRL WandbCallback pattern): W&B's offline _step restarts at 0 in segment 2
    for seg in range(2):
        run = wandb.init(project="lldtest", name="resumed_nostep", id=NOSTEP_ID, resume="allow")
        for i in range(3):
            run.log({"custom/x": float(seg * 3 + i), "critic/score/mean": value("critic/score/mean", seg * 3 + i)})
        run.finish()
    # the same with TRL's own axis: train/global_step continues across the resume
    for seg in range(2):
        run = wandb.init(project="lldtest", name="resumed_trl", id=TRL_RESUMED_ID, resume="allow",
                         config={"num_generations": 4, "use_kl_loss": False})
        for i in range(3):
            gs = seg * 3 + i + 1
            run.log({"train/reward": value("train/reward", gs), "train/global_step": gs})
        if seg == 1:
            import pandas as pd

            run.log({"train/rewards/em/mean": 0.5, "train/global_step": 6})
            df = pd.DataFrame({"step": [6, 6, 6], "prompt": ["q1", "q1", "q2"], "completion": ["a", "b", "c"],
                               "em": [1.0, 0.0, 1.0], "advantage": [0.7, -0.7, 0.0]})
            run.log({"completions": wandb.Table(dataframe=df)})  # as GRPOTrainer.log does (no global_step)
            run.summary["train_loss"] = 0.125  # summary-only scalars (transformers' end of training)
            run.summary["train_runtime"] = 42.0
        run.finish()
    # current verl: pg_loss / kl_loss summed over 2 epochs x 4 mini-batches, KL off
    run = wandb.init(project="lldtest", name="verl_sum", id="id-verl-sum", config={
        "algorithm": {"adv_estimator": "grpo"},
        "data": {"train_batch_size": 8},
        "actor_rollout_ref": {"actor": {"ppo_epochs": 2, "ppo_mini_batch_size": 2, "use_kl_loss": False}}})
    for s in range(3):
        run.log({"actor/pg_loss": 8.0 * (s + 1), "actor/kl_loss": 0.0, "actor/pg_clipfrac_lower": 0.0}, step=s)
    run.finish()
    # a run resumed with a gap in its steps (two offline folders, same id)
    exp = expected_resumed()
    for seg, steps in enumerate(RESUMED_STEPS):
        run = wandb.init(project="lldtest", name="resumed", id=RESUMED_ID, resume="allow",
                         config={"segment": seg} if seg == 0 else {"segment2": True})
        for s in steps:
            run.log(exp[s], step=s)
        run.finish()


@pytest.fixture(scope="module")
def wandb_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true", WANDB_CONFIG_DIR=str(root / "cfg"),
        WANDB_CACHE_DIR=str(root / "cache"), WANDB_DATA_DIR=str(root / "data"), WANDB_DISABLE_GIT="true",
        WANDB_CONSOLE="off",
    )
    env.pop("WANDB_API_KEY", None)
    subprocess.run([sys.executable, __file__, str(root)], check=True, env=env, timeout=240, cwd=root)
    return root / "wandb"


def _metric_map(df) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for step, key, val in zip(df["step"], df["key"], df["value"], strict=True):
        assert key not in out.setdefault(int(step), {}), f"duplicate metric {key} at step {step}"
        out[int(step)][key] = float(val)
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _assert_roundtrip(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(want)
    for s, row in want.items():
        g = {k: v for k, v in got[s].items() if not k.startswith("_")}
        assert set(g) == set(row), (s, set(g) ^ set(row))
        for k, v in row.items():
            assert _same(g[k], v), (s, k, g[k], v)


@pytest.fixture(scope="module")
def imported(wandb_dir, tmp_path_factory):
    from lld_monitor.integrations.wandb.importer import import_offline
    from lld_monitor.store import open_store_reader

    store = tmp_path_factory.mktemp("store") / "s"
    results = import_offline(str(store), wandb_dir, progress=False)
    reader = open_store_reader(store)
    yield store, {r.name: r for r in results}, reader
    reader.close()


def test_every_value_round_trips(imported):
    store, results, reader = imported
    for name in RUNS:
        res = results[name]
        got = _metric_map(reader.metrics(res.run_id))
        _assert_roundtrip(got, expected_rows(name))


def test_resumed_run_with_gap_is_merged(imported):
    _, results, reader = imported
    res = results["resumed"]
    got = _metric_map(reader.metrics(res.run_id))
    _assert_roundtrip(got, expected_resumed())
    steps = reader.steps(res.run_id)
    assert steps["step"].tolist() == RESUMED_STEPS[0] + RESUMED_STEPS[1]
    cfg = json.loads(reader.run(res.run_id)["config"])
    assert cfg["segment"] == 0 and cfg["segment2"] is True


def test_resumed_without_step_keeps_every_row(imported):
    """6 rows logged across an offline resume without step= (W&B restarts _step at 0) -> 6 steps imported."""
    _, results, reader = imported
    res = results["resumed_nostep"]
    m = reader.metrics(res.run_id)
    x = m[m["key"] == "custom/x"].sort_values("step")
    assert x["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert x["value"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(reader.steps(res.run_id)) == 6
    assert any("restarts _step at 0" in p for p in res.problems)  # said, not silent
    trl = results["resumed_trl"]
    st = reader.steps(trl.run_id).set_index("step")
    assert st.index.tolist() == [1, 2, 3, 4, 5, 6]
    for gs in range(1, 7):
        assert _same(float(st.loc[gs, "reward_mean"]), value("train/reward", gs))


def test_summary_scalars_and_completions_table(imported):
    _, results, reader = imported
    res = results["resumed_trl"]
    assert set(res.summary_keys) >= {"train_loss", "train_runtime"}
    m = reader.metrics(res.run_id)
    tl = m[m["key"] == "train_loss"]
    assert tl["value"].tolist() == [0.125] and tl["step"].tolist() == [6]  # at the last step
    assert res.samples == 3
    sm = reader.samples(res.run_id).sort_values("sample_idx")
    assert sm["step"].tolist() == [6, 6, 6]
    assert sm["reward"].tolist() == [1.0, 0.0, 1.0]  # the `em` reward column (train/rewards/em/mean names it)
    assert sm["advantage"].tolist() == [0.7, -0.7, 0.0]
    assert sm["text"].tolist() == ["a", "b", "c"]
    assert sm["group_id"].iloc[0] == sm["group_id"].iloc[1] != sm["group_id"].iloc[2]


def test_verl_loss_sum_rescaled_and_no_fake_kl(imported):
    _, results, reader = imported
    res = results["verl_sum"]
    st = reader.steps(res.run_id).set_index("step")
    assert st["pg_loss"].tolist() == [1.0, 2.0, 3.0]  # 8·(s+1) summed over 2 epochs × 4 mini-batches
    assert st["kl"].isna().all()  # use_kl_loss=False: verl's 0.0 is not a KL
    m = reader.metrics(res.run_id)
    assert m[m["key"] == "actor/pg_loss"]["value"].tolist() == [8.0, 16.0, 24.0]  # raw values kept
    assert any("divided by 8" in p for p in res.problems) and any("use_kl_loss" in p for p in res.problems)


def test_mapped_signals_in_steps(imported):
    _, results, reader = imported
    st = reader.steps(results["verl_llds"].run_id).set_index("step")
    for s in range(12):
        for sig, key in [("reward_mean", "critic/score/mean"), ("grad_norm", "actor/grad_norm"),
                         ("entropy", "actor/entropy_loss"), ("clip_frac", "actor/pg_clipfrac"),
                         ("kl", "actor/kl_loss"), ("llds_loss", "actor/loss_noreduce"),
                         ("searches_per_response", "env/number_of_valid_search"), ("step_time", "timing_s/step")]:
            assert _same(float(st.loc[s, sig]), value(key, s)), (s, sig)
    # diluted proxies / counts are NOT mapped onto our signals
    assert st["ll_correct_mean"].isna().all() and st["frac_actions_displaced"].isna().all()
    # answer prob only where a span was found
    ma = reader.steps(results["verl_llds_ma"].run_id).set_index("step")
    assert math.isnan(ma.loc[0, "answer_prob_mean"])
    assert ma.loc[1, "answer_prob_mean"] == value("actor/lowest_prob_avg_mean", 1)
    # TRL: the step axis is train/global_step, two log calls per step merge into one steps row
    trl = reader.steps(results["trl_plain"].run_id).set_index("step")
    assert trl.index.tolist() == [1, 2, 3, 4, 5]
    for s in [1, 2, 3, 4, 5]:
        assert _same(float(trl.loc[s, "reward_mean"]), value("train/reward", s))
        assert _same(float(trl.loc[s, "grad_norm"]), value("train/grad_norm", s))
        assert _same(float(trl.loc[s, "clip_frac"]), value("train/clip_ratio/region_mean", s))
    # completion length counts tool output when TRL runs tools: a proxy, kept in metrics only (docs/signals.md)
    assert trl["response_length"].isna().all()
    assert math.isnan(float(trl.loc[2, "grad_norm"]))
    assert "train/text_value" in results["trl_plain"].skipped_keys


def test_mode_inferred_from_config(imported):
    _, results, reader = imported
    modes = {name: reader.run(r.run_id)["mode"] for name, r in results.items()}
    assert modes == {"verl_llds": "llds", "verl_llds_ma": "llds_ma", "verl_vanilla": "vanilla",
                     "trl_plain": "vanilla", "nocfg": "unknown", "resumed": "vanilla",
                     "resumed_nostep": "vanilla", "resumed_trl": "vanilla", "verl_sum": "vanilla"}
    runs = reader.runs().set_index("run_id")
    assert set(runs.loc[[r.run_id for r in results.values()], "source"]) == {"wandb"}
    assert set(runs.loc[[r.run_id for r in results.values()], "status"]) == {"finished"}


def test_reimport_updates_without_duplicates_and_mode_override(imported, wandb_dir):
    from lld_monitor.integrations.wandb.importer import import_offline
    from lld_monitor.store import open_store_reader

    store, results, _ = imported
    again = import_offline(str(store), next(wandb_dir.glob("offline-run-*id-verl-vanilla")), mode="llds",
                           progress=False)
    assert len(again) == 1 and again[0].run_id == results["verl_vanilla"].run_id
    with open_store_reader(store) as r:
        assert (r.runs()["run_id"] == again[0].run_id).sum() == 1
        assert r.run(again[0].run_id)["mode"] == "llds"
        m = r.metrics(again[0].run_id)
        assert not m.duplicated(["step", "key"]).any()
        _assert_roundtrip(_metric_map(m), expected_rows("verl_vanilla"))
        assert len(r.steps(again[0].run_id)) == 6


def test_detector_runs_on_imported_run(imported, capsys):
    detect = pytest.importorskip("lld_monitor.detect")
    from lld_monitor.cli import main

    store, results, reader = imported
    sig = reader.signals(results["verl_llds"].run_id)
    res = detect.detect_run(sig)
    assert res.phase in ("healthy", "stagnation", "decay", "collapse")
    capsys.readouterr()
    assert main(["detect", "--store", str(store), "--run", results["verl_llds"].run_id, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out  # the detect command reads the imported run like a local one


def test_forecast_on_imported_runs(imported, capsys):
    """The collapse forecast on these W&B runs: `forecast --json` gives each one the scalars model (verl and TRL
    log no displacement of preserved responses), a p in [0, 1] at its steps (none for a run that logs nothing the detector reads),
    and the very p that the detector state stored at import time restores without replaying a row."""
    from lld_monitor.cli import main
    from lld_monitor.detect.checkpoint import detect_resumed

    store, results, reader = imported
    capsys.readouterr()
    assert main(["forecast", "--store", str(store), "--json"]) == 0
    out = {r["name"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert set(out) == set(results)
    for name, res in results.items():
        rec = out[name]
        det, replayed = detect_resumed(reader.signals(res.run_id), lambda rid=res.run_id: reader.detector_state(rid))
        assert replayed == 0, name
        assert rec["model"] == det.forecast_model.name == "scalars", name
        got = {s["step"]: s["p_collapse"] for s in rec["steps"] if s["p_collapse"] is not None}
        assert got == dict(det.forecast), name
        if name in ("nocfg", "verl_sum"):  # custom keys only / pg and kl loss only: nothing the detector reads
            assert not got and rec["steps"], name
        else:
            assert got and all(0.0 <= v <= 1.0 for v in got.values()), name


# ------------------------------------------------------------------- damaged / in-progress files


def _one_file(wandb_dir: Path, run: str) -> Path:
    return next(wandb_dir.glob(f"offline-run-*{run}/run-*.wandb"))


def test_partial_tail_and_truncation(wandb_dir, tmp_path):
    from lld_monitor.integrations.wandb.offline_file import read_wandb_file

    src = _one_file(wandb_dir, "id-verl-llds")
    full = read_wandb_file(src)
    assert full.complete and not full.truncated and not full.problems
    data = src.read_bytes()
    n_hist = []
    # cut the file at many points: never an error, a growing prefix of the history, never complete
    for frac in np.linspace(0.05, 0.97, 23):
        cut = tmp_path / f"cut-{frac:.2f}.wandb"
        cut.write_bytes(data[: int(len(data) * frac)])
        d = read_wandb_file(cut)
        assert not d.complete
        assert d.history == full.history[: len(d.history)]
        n_hist.append(len(d.history))
    assert n_hist == sorted(n_hist) and n_hist[-1] > 0
    # a cut inside a record header or payload is reported as a partial tail
    assert any(read_wandb_file(tmp_path / f"cut-{f:.2f}.wandb").truncated for f in np.linspace(0.05, 0.97, 23))


def test_crc_error_skips_block_and_keeps_the_rest(wandb_dir, tmp_path):
    from lld_monitor.integrations.wandb.offline_file import read_wandb_file

    src = _one_file(wandb_dir, "id-verl-llds")
    full = read_wandb_file(src)
    data = bytearray(src.read_bytes())
    # flip a byte inside a history payload: find the value_json of a step-7 metric
    needle = json.dumps(value("actor/kl_loss", 7)).encode()
    pos = data.find(needle)
    assert pos > 0
    data[pos] ^= 0x01
    bad = tmp_path / "bad.wandb"
    bad.write_bytes(bytes(data))
    d = read_wandb_file(bad)
    assert any("CRC" in p for p in d.problems)
    steps = [h["_step"] for h in d.history]
    assert 7 not in steps  # the damaged record is dropped, not decoded into a wrong value
    for h in d.history:
        assert h == next(f for f in full.history if f["_step"] == h["_step"])


def test_foreign_file_is_rejected_and_folder_import_continues(wandb_dir, tmp_path):
    from lld_monitor.integrations.wandb.importer import ImportError_, import_offline
    from lld_monitor.integrations.wandb.offline_file import NotAWandbFileError, read_wandb_file

    junk = tmp_path / "run-junk.wandb"
    junk.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(NotAWandbFileError, match="not a W&B run file"):
        read_wandb_file(junk)
    folder = tmp_path / "mixed"
    shutil.copytree(next(wandb_dir.glob("offline-run-*id-nocfg")), folder / "offline-run-x-id-nocfg")
    shutil.copy(junk, folder / "run-junk.wandb")
    res = import_offline(str(tmp_path / "store"), folder, progress=False)
    assert [r.name for r in res] == ["nocfg"]
    assert junk.read_bytes().startswith(b"PK")  # never modified
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ImportError_, match="no .wandb run files"):
        import_offline(str(tmp_path / "store"), empty, progress=False)


def test_run_still_being_written_imports_its_prefix(wandb_dir, tmp_path):
    from lld_monitor.integrations.wandb.importer import import_offline
    from lld_monitor.store import open_store_reader

    src = _one_file(wandb_dir, "id-verl-llds")
    data = src.read_bytes()
    live = tmp_path / "live" / "run-id-verl-llds.wandb"
    live.parent.mkdir()
    live.write_bytes(data[: int(len(data) * 0.6)])
    res = import_offline(str(tmp_path / "st"), live, progress=False)[0]
    assert res.status == "running"
    with open_store_reader(tmp_path / "st") as r:
        got = _metric_map(r.metrics(res.run_id))
        want = expected_rows("verl_llds")
        assert 0 < len(got) < len(want)
        _assert_roundtrip(got, {s: want[s] for s in got})
        cfg = json.loads(r.run(res.run_id)["config"])
        assert cfg["_lld_monitor_import"]["wandb_state"] == "running"


LIVE_WRITER = r"""
import sys, time, wandb
run = wandb.init(project="live", id="liverun", name="live")
for s in range(5000):
    run.log({"actor/grad_norm": s * 0.5, "critic/score/mean": s * 0.25}, step=s)
    if s % 10 == 0:
        time.sleep(0.01)
    if __import__("os").path.exists(sys.argv[1]):
        break
run.finish()
"""


def test_reading_while_the_sdk_writes(tmp_path):
    """Read the .wandb file of a run the real SDK is writing right now: every read is a clean prefix."""
    import time

    from lld_monitor.integrations.wandb.offline_file import find_run_files, read_wandb_file

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", WANDB_CONSOLE="off",
               WANDB_CONFIG_DIR=str(tmp_path / "cfg"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
               WANDB_DATA_DIR=str(tmp_path / "data"))
    stop = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(stop)], env=env, cwd=tmp_path)
    try:
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len([n for n in seen if n > 0]) < 5:
            files = find_run_files(tmp_path / "wandb") if (tmp_path / "wandb").exists() else []
            if files:
                d = read_wandb_file(files[0])
                assert not any("CRC" in p or "bad record header" in p for p in d.problems), d.problems
                for h in d.history:
                    assert h["actor/grad_norm"] == h["_step"] * 0.5
                assert [h["_step"] for h in d.history] == list(range(len(d.history)))
                if d.history:
                    assert not d.complete
                seen.append(len(d.history))
            time.sleep(0.1)
        assert len([n for n in seen if n > 0]) >= 5, seen
        assert seen == sorted(seen)
        stop.touch()
        assert proc.wait(timeout=60) == 0
        final = read_wandb_file(find_run_files(tmp_path / "wandb")[0])
        assert final.complete and len(final.history) >= seen[-1]
    finally:
        stop.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_offline_import(wandb_dir, tmp_path, capsys):
    from lld_monitor.cli import main

    store = tmp_path / "cli-store"
    rc = main(["import-wandb", "--store", str(store), "--offline", str(wandb_dir), "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and not out["missing"] and not out["failed"]
    by_name = {r["name"]: r for r in out["imported"]}
    assert set(by_name) == set(RUNS) | {"resumed", "resumed_nostep", "resumed_trl", "verl_sum"}
    assert by_name["verl_llds"]["mapped"]["grad_norm"] == "actor/grad_norm"
    assert by_name["verl_llds"]["mode"] == "llds" and by_name["verl_llds"]["rows"] == 12
    assert main(["import-wandb", "--store", str(store)]) == 2
    assert main(["import-wandb", "--store", str(store), "--entity", "e"]) == 2
    assert main(["import-wandb", "--store", str(store), "--offline", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err


if __name__ == "__main__":
    write_runs(sys.argv[1])
