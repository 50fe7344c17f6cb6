"""RunLogger: copies on the caller thread, crash marking (with / excepthook / SIGTERM), sampling,
the online detector's alerts, NaN/inf and torch tensors stored faithfully."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lld_monitor.logger import LoggerOptions, RunLogger
from lld_monitor.store import open_store_reader


def _samples(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"reward": (rng.random(n) > 0.5).astype(float), "advantage": rng.normal(size=n),
            "group_id": np.repeat(np.arange(n // 4), 4)}


def _child(code: str, store) -> subprocess.Popen:
    src = "import sys, time, numpy as np\nfrom lld_monitor.logger import RunLogger\n" + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", src, str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_exception_in_with_block_marks_crashed(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with RunLogger(tmp_path, "boom", "vanilla", handle_signals=False, detector=False) as lg:
            lg.log_step(0, samples=_samples())
            1 / 0
    row = open_store_reader(tmp_path).run(lg.run_id)
    assert row["status"] == "crashed" and row["steps"] == 1


def test_unhandled_exception_marks_crashed_and_keeps_previous_hook(tmp_path):
    p = _child("""
        called = []
        prev = sys.excepthook
        sys.excepthook = lambda *a: (print("PREVIOUS HOOK", flush=True), prev(*a))
        lg = RunLogger(sys.argv[1], "unhandled", "vanilla", detector=False)
        for s in range(3):
            lg.log_step(s, samples={"reward": np.ones(4), "advantage": np.zeros(4), "group_id": np.zeros(4)})
        raise RuntimeError("training blew up")
        """, tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "PREVIOUS HOOK" in out and "training blew up" in err
    row = open_store_reader(tmp_path).runs().iloc[0]
    assert row["status"] == "crashed" and row["steps"] == 3


def test_sigterm_marks_crashed_and_chains_previous_handler(tmp_path):
    flag = tmp_path / "prev_handler_ran"
    p = _child(f"""
        import signal
        signal.signal(signal.SIGTERM, lambda *a: (open({str(flag)!r}, "w").write("1"), sys.exit(143)))
        lg = RunLogger(sys.argv[1], "terminated", "vanilla", flush_every_steps=1000, flush_every_s=60, detector=False)
        for s in range(5):
            lg.log_step(s, samples={{"reward": np.ones(4), "advantage": np.zeros(4), "group_id": np.zeros(4)}})
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
        """, tmp_path / "s")
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    assert p.returncode == 143 and flag.exists()
    row = open_store_reader(tmp_path / "s").runs().iloc[0]
    assert row["status"] == "crashed"
    assert row["steps"] == 5, "steps queued before SIGTERM are flushed, not lost"


def test_sigterm_with_default_handler_still_dies_of_sigterm(tmp_path):
    p = _child("""
        lg = RunLogger(sys.argv[1], "terminated", "vanilla", detector=False)
        lg.log_step(0, samples={"reward": np.ones(4), "advantage": np.zeros(4), "group_id": np.zeros(4)})
        print("ready", flush=True)
        time.sleep(60)
        """, tmp_path)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGTERM
    assert open_store_reader(tmp_path).runs().iloc[0]["status"] == "crashed"


def test_normal_exit_without_close_marks_finished(tmp_path):
    p = _child("""
        lg = RunLogger(sys.argv[1], "forgot close", "vanilla", detector=False)
        for s in range(4):
            lg.log_step(s, samples={"reward": np.ones(4), "advantage": np.zeros(4), "group_id": np.zeros(4)})
        """, tmp_path)
    p.communicate(timeout=60)
    assert p.returncode == 0
    row = open_store_reader(tmp_path).runs().iloc[0]
    assert row["status"] == "finished" and row["steps"] == 4


def test_inputs_are_copied_on_the_caller_thread(tmp_path):
    reward = np.ones(8)
    logp = np.full((8, 6), -1.0)
    with RunLogger(tmp_path, "copy", "vanilla", handle_signals=False, detector=False,
                   options=LoggerOptions(queue_size=1)) as lg:
        for s in range(20):
            lg.log_step(s, samples={**_samples(), "reward": reward}, tokens={"token_id": np.zeros((8, 6), int),
                                                                             "logp_old": logp, "logp_new": logp})
            reward[:] = -5.0  # the caller reuses its buffers at once
            logp[:] = 7.0
            reward[:] = 1.0
            logp[:] = -1.0
    r = open_store_reader(tmp_path)
    assert (r.samples(lg.run_id)["reward"] == 1.0).all()
    assert len(r.samples(lg.run_id)) == 160, "a queue of one item still loses nothing"
    assert (r.sql("SELECT DISTINCT logp_old FROM tokens")["logp_old"] == -1.0).all()


def test_token_sampling_every_k_steps_m_groups_and_exact_aggregates(tmp_path):
    n, t = 12, 5
    with RunLogger(tmp_path, "sampled", "vanilla", token_every=3, token_groups=2, handle_signals=False,
                   detector=False) as lg:
        for s in range(7):
            smp = _samples(n, seed=s)
            lg.log_step(s, samples=smp, tokens={"token_id": np.ones((n, t), int), "logp_old": np.zeros((n, t)),
                                                "logp_new": np.zeros((n, t))})
    r = open_store_reader(tmp_path)
    assert r.token_steps(lg.run_id) == [0, 3, 6]
    tok = r.tokens(lg.run_id, 3)
    assert sorted(tok["sample_idx"].unique()) == list(range(8))  # the first 2 groups of 4
    steps = r.steps(lg.run_id)
    assert (steps["n_samples"] == n).all(), "aggregates use every sample, not the token sample"
    assert steps["reward_mean"].tolist() == pytest.approx([_samples(n, seed=s)["reward"].mean() for s in range(7)])


def test_all_samples_drive_aggregates_and_scalars_win(tmp_path):
    allr = {"reward": np.array([1.0, 0.0, 0.0, 0.0]), "advantage": np.zeros(4), "group_id": np.zeros(4)}
    with RunLogger(tmp_path, "gathered", "vanilla", handle_signals=False, detector=False) as lg:
        lg.log_step(0, scalars={"reward_std": 9.0, "my/extra": 3.0}, samples={k: v[:2] for k, v in allr.items()},
                    all_samples=allr)
    r = open_store_reader(tmp_path)
    st = r.steps(lg.run_id).iloc[0]
    assert st["n_samples"] == 4 and st["reward_mean"] == 0.25 and st["reward_std"] == 9.0
    assert len(r.samples(lg.run_id)) == 2
    assert r.metrics(lg.run_id)[["key", "value"]].values.tolist() == [["my/extra", 3.0]]


def test_nan_inf_and_torch_tensors_stored_faithfully(tmp_path):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    n, t = 4, 3
    logp = torch.tensor([[float("nan"), float("inf"), -1.0]] * n, dtype=torch.bfloat16, requires_grad=True)
    with RunLogger(tmp_path, "nan", "vanilla", handle_signals=False, detector=False) as lg:
        lg.log_step(0, scalars={"grad_norm": torch.tensor(float("inf")), "kl": float("nan")},
                    samples={"reward": torch.tensor([float("nan"), 1.0, float("-inf"), 0.0]),
                             "advantage": torch.zeros(n), "group_id": torch.zeros(n, dtype=torch.long)},
                    tokens={"token_id": torch.ones((n, t), dtype=torch.long), "logp_old": logp, "logp_new": logp * 2})
    r = open_store_reader(tmp_path)
    s = r.sql("SELECT reward, isnan(reward) AS nan_, reward IS NULL AS null_ FROM samples ORDER BY sample_idx")
    assert s["nan_"].tolist() == [True, False, False, False] and not s["null_"].any()
    assert s["reward"].tolist()[2] == float("-inf")
    st = r.sql("SELECT grad_norm, isnan(kl) AS kl_nan, kl IS NULL AS kl_null, isnan(reward_mean) AS rm_nan FROM steps")
    assert st["grad_norm"][0] == float("inf") and st["kl_nan"][0] and not st["kl_null"][0] and st["rm_nan"][0]
    tk = r.sql("SELECT position, isnan(logp_old) AS n_, logp_old FROM tokens WHERE sample_idx = 0 ORDER BY position")
    assert tk["n_"].tolist() == [True, False, False] and tk["logp_old"].tolist()[1:] == [float("inf"), -1.0]


def test_online_detector_alerts_land_in_the_store(tmp_path):
    detect = pytest.importorskip("lld_monitor.detect")
    from lld_monitor.detect.synthetic import spiral

    sig = spiral()
    cols = [c for c in sig.columns if c != "step"]
    with RunLogger(tmp_path, "spiral", "vanilla", handle_signals=False, flush_every_steps=50) as lg:
        for _, row in sig.iterrows():
            lg.log_step(int(row["step"]), scalars={c: float(row[c]) for c in cols if np.isfinite(row[c])})
    ref = detect.OnlineDetector()
    expected = []
    for _, row in sig.iterrows():
        expected += ref.update(int(row["step"]), {c: float(row[c]) for c in cols if np.isfinite(row[c])})
    stored = open_store_reader(tmp_path).alerts(lg.run_id)
    assert len(expected) > 0
    assert stored[["step", "phase", "severity", "signal"]].values.tolist() == [
        [a.step, a.phase, a.severity, a.signal] for a in expected]


def test_bad_log_step_input_is_a_clear_error_at_the_call(tmp_path):
    with RunLogger(tmp_path, "bad", "vanilla", handle_signals=False, detector=False) as lg:
        with pytest.raises(ValueError, match="missing"):
            lg.log_step(0, samples={"reward": np.ones(3)})
        with pytest.raises(ValueError, match="unknown samples column"):
            lg.log_step(0, samples={**_samples(4), "rewardd": np.ones(4)})
        with pytest.raises(ValueError, match="differ in length"):
            lg.log_step(0, samples={**_samples(4), "reward": np.ones(3)})
        with pytest.raises(ValueError, match="single number"):
            lg.log_step(0, scalars={"kl": np.ones(3)})
        with pytest.raises(ValueError, match="must be a number"):
            lg.log_step(0, scalars={"kl": "high"})
        with pytest.raises(ValueError, match=r"\[N=4, T\]"):
            lg.log_step(0, samples=_samples(4), tokens={"token_id": np.ones((3, 2))})
        lg.log_step(1, samples=_samples(4))
    assert open_store_reader(tmp_path).run(lg.run_id)["steps"] == 1


def test_store_and_logger_never_import_torch(tmp_path):
    code = ("import sys, numpy as np; import lld_monitor.store, lld_monitor.logger, lld_monitor.commands.runs\n"
            "from lld_monitor.logger import RunLogger\n"
            f"lg = RunLogger({str(tmp_path)!r}, 'x', 'vanilla')\n"
            "lg.log_step(0, samples={'reward': np.ones(2), 'advantage': np.ones(2), 'group_id': [0, 0]}); lg.close()\n"
            "lld_monitor.store.open_store_reader(sys.argv[1]).runs()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)


class _RecordingRun:
    """Stands in for a wandb Run (WandbExporter accepts anything with .log); records what it gets."""

    def __init__(self):
        self.logged: list[dict] = []

    def log(self, data, **kw):
        self.logged.append(dict(data))


def test_wandb_forwarding_sends_signals_and_alerts(tmp_path):
    pytest.importorskip("lld_monitor.integrations.wandb.export")
    pytest.importorskip("lld_monitor.detect")
    from lld_monitor.detect.synthetic import spiral

    sig = spiral()
    cols = [c for c in sig.columns if c != "step"]
    from lld_monitor.integrations.wandb.export import WandbExporter

    run = _RecordingRun()
    with RunLogger(tmp_path, "wb", "vanilla", handle_signals=False, sinks=[WandbExporter(run)]) as lg:
        for _, row in sig.iterrows():
            lg.log_step(int(row["step"]), scalars={c: float(row[c]) for c in cols if np.isfinite(row[c])})
    steps = [d for d in run.logged if "lld/step" in d]
    assert len(steps) == len(sig)
    assert steps[10]["lld/reward_mean"] == pytest.approx(float(sig["reward_mean"].iloc[10]))
    n_alerts = len(open_store_reader(tmp_path).alerts(lg.run_id))
    assert n_alerts > 0 and max(d.get("lld/alerts_total", 0) for d in run.logged) == n_alerts
