"""W&B export: RunLogger(..., sinks=[WandbExporter(run)]) sends step signals and alerts to a real (offline) wandb run; the
.wandb file read back holds exactly what the store holds, and importing it gives the same step signals."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from lld_monitor.detect import Alert

N_STEPS = 12


def write(root: str, store: str) -> None:
    """Subprocess: a training loop that logs to the store and, through RunLogger, to W&B (offline)."""
    import wandb

    from lld_monitor.integrations.wandb.export import WandbExporter
    from lld_monitor.logger import RunLogger

    run = wandb.init(project="exp", name="exported", id="exported1", config={"mode": "llds", "lam": 0.2})
    rng = np.random.default_rng(0)
    with RunLogger(store, "exported", "llds", {"lam": 0.2}, run_id="local-exported", sinks=[WandbExporter(run)],
                   flush_every_steps=1) as log:
        for step in range(N_STEPS):
            n = 8
            log.log_step(
                step,
                scalars={"grad_norm": float(rng.random()), "custom_metric": float(step) * 0.5},
                samples={"reward": rng.integers(0, 2, n).astype(float), "advantage": rng.normal(size=n),
                         "group_id": np.repeat(np.arange(2), 4), "logp_old_sum": rng.normal(size=n) - 5,
                         "logp_new_sum": rng.normal(size=n) - 5, "n_action_tokens": np.full(n, 10)},
            )
        log.flush()
    WandbExporter(run).log_alerts([Alert(11, "decay", "critical", "grad_norm", 9.0, 5.0, "grad norm spike")])
    run.finish()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("wbx")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true", WANDB_CONFIG_DIR=str(root / "cfg"),
               WANDB_CACHE_DIR=str(root / "cache"), WANDB_DATA_DIR=str(root / "data"), WANDB_CONSOLE="off")
    store = root / "store"
    subprocess.run([sys.executable, __file__, str(root), str(store)], check=True, env=env, timeout=240, cwd=root)
    return root / "wandb", store


def test_exported_values_equal_the_store(exported):
    from lld_monitor.detect import detect_run
    from lld_monitor.integrations.wandb.offline_file import read_offline_runs
    from lld_monitor.store import open_store_reader

    wdir, store = exported
    (data,) = read_offline_runs(wdir)
    rows = [h for h in data.history if "lld/step" in h]
    assert len(rows) == N_STEPS + 1  # one per step + the alert call
    by_step = {int(h["lld/step"]): h for h in rows[:N_STEPS]}
    with open_store_reader(store) as r:
        st = r.steps("local-exported").set_index("step")
        for s in range(N_STEPS):
            h = by_step[s]
            for sig in ("reward_mean", "accuracy", "grad_norm", "delta_preserved", "ll_correct_sum"):
                v = st.loc[s, sig]
                if v is None or (isinstance(v, float) and math.isnan(v)):
                    assert f"lld/{sig}" not in h or math.isnan(h[f"lld/{sig}"])
                else:
                    assert h[f"lld/{sig}"] == pytest.approx(float(v), rel=1e-12), (s, sig)
            assert h["lld/custom_metric"] == s * 0.5
        forecast = dict(detect_run(r.signals("local-exported")).forecast)  # the model RunLogger's detector chose
    assert forecast and set(forecast) <= set(by_step)
    for s, p in forecast.items():  # lld/p_collapse is the online detector's forecast, as the offline replay has it
        assert by_step[s]["lld/p_collapse"] == pytest.approx(p, abs=1e-12), s
    last = rows[-1]
    assert last["lld/alerts_total"] >= 1 and last["lld/phase"] == 2  # PHASES.index("decay")
    assert isinstance(last["lld/alerts"], dict) and last["lld/alerts"].get("_type") == "table-file"


def test_import_of_exported_run_gives_back_the_signals(exported, tmp_path):
    from lld_monitor.integrations.wandb.importer import import_offline
    from lld_monitor.store import open_store_reader

    wdir, store = exported
    (res,) = import_offline(str(tmp_path / "s2"), wdir, progress=False)
    assert res.mode == "llds"
    assert "lld/alerts" in res.skipped_keys  # the alerts table is media, not a scalar
    with open_store_reader(store) as a, open_store_reader(tmp_path / "s2") as b:
        orig = a.steps("local-exported").set_index("step")
        back = b.steps(res.run_id).set_index("step")
        assert list(back.index[:N_STEPS]) == list(range(N_STEPS))
        assert not any(k.startswith("lld/alerts.") for k in b.metrics(res.run_id)["key"])
        for sig in ("reward_mean", "reward_std", "accuracy", "grad_norm", "delta_preserved",
                    "frac_responses_displaced", "ll_correct_sum", "ll_incorrect_sum"):
            x = orig[sig].to_numpy(dtype=float)
            y = back.loc[range(N_STEPS), sig].to_numpy(dtype=float)
            assert np.allclose(x, y, equal_nan=True, rtol=1e-12), sig


def test_exporter_requires_a_run():
    from lld_monitor.integrations.wandb.export import WandbExporter

    with pytest.raises(ValueError, match="active wandb run"):
        WandbExporter(None)


if __name__ == "__main__":
    write(sys.argv[1], sys.argv[2])
