"""LLDGRPOTrainer with two processes (issue 29, items 5 and 4): `torchrun --nproc_per_node 2` on CPU (gloo), a real
TRL 1.16 GRPOTrainer in each process (tests/_trl_multiproc_run.py), with LLDS on.

(a) a RunLogger on the main process only: the old hook called `accelerator.gather` on that process alone and hung;
(b) `lld_store=` on every process: one run, both ranks' samples and tokens.
The optimizer step's LLDS value, summed from its micro-batches on both processes, equals λ·L_LLDS of the whole
step recomputed from the stored tokens (the paper's response norm: divide by the step's preserved responses).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from _net import free_port  # noqa: E402

from lld_monitor import lld  # noqa: E402
from lld_monitor.store import open_store_reader  # noqa: E402

TESTS = Path(__file__).resolve().parent
LAM = 0.3  # as tests/_trl_multiproc_run.py


def _step_llds_from_tokens(r, run_id: str, step: int, micro: int | None = None) -> float:
    """λ·L_LLDS (response norm, token gate) of every sample of `step`, all ranks, from the stored tokens; with `micro`,
    what the old hook added instead: the mean over micro-batches (`micro` consecutive samples per rank) of each
    micro-batch's own λ·L_LLDS."""
    samples = r.samples(run_id, step=step)
    tokens = r.tokens(run_id, step)
    keys = list(zip(samples["rank"], samples["sample_idx"], strict=True))
    t_max = int(tokens["position"].max()) + 1
    new = np.zeros((len(keys), t_max), dtype=np.float32)
    old = np.zeros_like(new)
    mask = np.zeros((len(keys), t_max), dtype=bool)
    for i, (rank, idx) in enumerate(keys):
        t = tokens[(tokens["rank"] == rank) & (tokens["sample_idx"] == idx)]
        pos = t["position"].to_numpy()
        new[i, pos] = t["logp_new"].to_numpy()
        old[i, pos] = t["logp_old"].to_numpy()
        mask[i, pos] = (t["role"] != "tool").to_numpy()
    adv = torch.tensor(samples["advantage"].to_numpy(), dtype=torch.float32)
    new_t, old_t, mask_t = torch.from_numpy(new), torch.from_numpy(old), torch.from_numpy(mask)
    cfg = lld.LLDSConfig(lam=LAM, norm="response", gate="token")  # as tests/_trl_multiproc_run.py
    if micro is not None:
        parts = [slice(a, a + micro) for a in range(0, len(keys), micro)]
        return float(np.mean([LAM * float(lld.llds_loss(new_t[s], old_t[s], adv[s], mask_t[s], cfg)[0]) for s in parts]))
    loss, st = lld.llds_loss(new_t, old_t, adv, mask_t, cfg)
    assert st["n_penalized_tokens"] > 0
    return LAM * float(loss)


@pytest.mark.slow
def test_two_processes_logger_on_main_only_and_on_every_rank(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(TESTS / "_trl_multiproc_run.py"), str(tmp_path)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:  # a collective on a subset of the processes waits forever
        pytest.fail(f"2-process TRL run did not finish in 240 s (deadlock?): {str(e.stderr)[-3000:]}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    for rank in (0, 1):
        assert f"rank {rank}: main-only run done" in proc.stdout and f"rank {rank}: every-rank run done" in proc.stdout

    values = {}
    for store, ranks_with_samples in (("store_main", {0}), ("store_all", {0, 1})):
        with open_store_reader(tmp_path / store) as r:
            runs = r.runs()
            assert len(runs) == 1, runs
            run = runs.iloc[0]
            assert run["status"] == "finished" and run["world_size"] == 2 and run["mode"] == "llds"
            steps = r.steps(run["run_id"]).set_index("step")
            assert steps.index.tolist() == [1, 2]
            assert (steps["n_samples"] == 8).all()  # the step row counts both processes' samples
            sm = r.samples(run["run_id"], step=2)
            assert set(sm["rank"]) == ranks_with_samples and (sm.groupby("rank").size() == 4).all()
            gated = r.metrics(run["run_id"]).query("key == 'llds_noise_gated'").set_index("step")["value"]
            # step 1: first pass over the generation batch, old log-probs = the current parameters: no LLDS term
            assert steps.loc[1, "llds_loss"] == 0.0 and gated.loc[1] == 1.0
            assert steps.loc[2, "llds_loss"] > 0 and gated.loc[2] == 0.0
            values[store] = steps.loc[2, "llds_loss"]
            if store == "store_all":
                whole = _step_llds_from_tokens(r, run["run_id"], 2)
                assert steps.loc[2, "llds_loss"] == pytest.approx(whole, rel=1e-4)
                # the micro-batches hold 2 and 1 preserved responses: per-micro-batch normalization is off
                assert abs(_step_llds_from_tokens(r, run["run_id"], 2, micro=2) - whole) > 1e-3 * whole
    assert values["store_main"] == pytest.approx(values["store_all"], rel=1e-6)  # same seeds, same training
