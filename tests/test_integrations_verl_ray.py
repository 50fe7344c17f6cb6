"""The verl driver hook through Ray (issue 29, item 1): the user's launch command, a local Ray instance with 2 CPUs.

`python -m lld_monitor.integrations.trainers.verl_hook <verl overrides>` runs verl's own `run_ppo`: Ray ships the task-runner
actor class to a worker process, verl's `TaskRunner.run` validates the config, loads the tokenizer and datasets and
builds the trainer there. The trainer built inside the actor must be ours and write rows. Only what needs GPUs and
a rollout engine is replaced, in the Ray workers, by tests/_verl_ray_stubs.py (`init_workers`, the generation loop
of `fit`, what the actor worker group returns). The old hook set `main_ppo_v0.RayPPOTrainer` on a class Ray
shipped by value: plain verl trained and no row was written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl", reason="verl is an optional extra (docs/integrations.md, 'Installing: two paths')")
pytest.importorskip("ray")

TESTS = Path(__file__).resolve().parent


def _tiny_model_and_data(root: Path) -> None:
    import pandas as pd
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["question: what is the capital of france? <answer> paris </answer>"] * 5,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<unk>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    hf.save_pretrained(root / "model")
    cfg = Qwen2Config(vocab_size=len(hf), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    Qwen2ForCausalLM(cfg).save_pretrained(root / "model")
    rows = [{"prompt": [{"role": "user", "content": f"question: what is the capital {i}"}], "data_source": "t",
             "reward_model": {"ground_truth": "paris", "style": "rule"}, "extra_info": {"index": i}} for i in range(8)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows).to_parquet(root / "val.parquet")


@pytest.mark.slow
def test_trainer_built_inside_the_ray_actor_is_ours_and_writes_rows(tmp_path):
    from lld_monitor.integrations.trainers.verl_hook import SHARE_KEY, TIMING_KEY
    from lld_monitor.store import open_store_reader

    _tiny_model_and_data(tmp_path)
    out = tmp_path / "steps.jsonl"
    store = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "LLD_VERL_RAY_OUT": str(out), "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable, "-m", "lld_monitor.integrations.trainers.verl_hook",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}", f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'val.parquet'}", "data.train_batch_size=4", "data.max_prompt_length=16",
        "data.max_response_length=8", "data.dataloader_num_workers=0", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.use_v1=False",
        "trainer.logger=[console]", "trainer.experiment_name=lld-ray-test", f"+trainer.lld_store={store}",
        "trainer.device=cpu", "ray_kwargs.ray_init.num_cpus=2", "+ray_kwargs.ray_init.include_dashboard=false",
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=_verl_ray_stubs.install",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    steps = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert {s["trainer"] for s in steps} == {"LLDRayPPOTrainer"}, "the trainer verl built inside the actor is not ours"
    assert all(s["pid"] != os.getpid() for s in steps)  # it ran in the Ray actor's process
    # item 7: the extra log-prob pass has its own timing key in verl's (reduced) actor metrics
    assert all(TIMING_KEY in s["metrics"] and SHARE_KEY in s["metrics"] for s in steps)
    assert "is the trainer" in proc.stdout + proc.stderr  # the worker's log says the hook is active
    with open_store_reader(store) as r:
        runs = r.runs()
        assert len(runs) == 1
        run = runs.iloc[0]
        assert run["source"] == "verl" and run["status"] == "finished"
        assert r.token_steps(run["run_id"]) == [1, 2]
        tok = r.tokens(run["run_id"], 1)
        assert len(tok) > 0 and (tok["role"] == "tool").any()
        act = tok[tok["role"] == "action"]
        assert ((act["logp_new"] - act["logp_old"]).round(5) == -0.05).all()
        st = r.steps(run["run_id"]).set_index("step")
        assert (st["frac_responses_displaced"] == 1.0).all()
        assert TIMING_KEY in set(r.metrics(run["run_id"])["key"])


def test_a_verl_whose_task_runner_moved_is_refused():
    """If verl's TaskRunner.run no longer builds `RayPPOTrainer` by that name the hook says so, never trains plain verl."""
    from verl.trainer import main_ppo_v0

    from lld_monitor.integrations.trainers.verl_hook import LLDRayPPOTrainer, UnsupportedVerlError, install_trainer

    def run(self, config):  # builds its trainer under another name
        return config

    with pytest.raises(UnsupportedVerlError, match="use_v1=False"):
        install_trainer(run)
    base_run = main_ppo_v0.TaskRunner.__ray_actor_class__.run
    before = base_run.__globals__["RayPPOTrainer"]
    try:
        install_trainer(base_run)
        assert main_ppo_v0.RayPPOTrainer is LLDRayPPOTrainer
    finally:
        base_run.__globals__["RayPPOTrainer"] = before
