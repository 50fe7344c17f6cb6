"""Ray worker setup hook for tests/test_integrations_verl_ray.py (not a test module).

Installed in every Ray worker process with ``ray_kwargs.ray_init.runtime_env.worker_process_setup_hook``, it
replaces only what needs GPUs and a rollout engine on verl's *own* ``RayPPOTrainer``: ``init_workers`` (no worker
groups), the generation loop of ``fit`` (a minimal loop over verl's real train dataloader with made-up responses)
and what the actor worker group would return (``_update_actor`` metrics, ``_compute_old_log_prob`` log-probs).
Everything else — the launcher, ``run_ppo``, Ray shipping the TaskRunner class, verl's ``TaskRunner.run``
(config validation, tokenizer, datasets, building the trainer) — is verl's and Ray's code. A subclass of
``RayPPOTrainer`` inherits these stubs; its own overrides (lld-monitor's ``_update_actor`` and ``fit``) stay on
top. What the loop saw goes, one JSON line per step, to ``$LLD_VERL_RAY_OUT``.
"""

from __future__ import annotations

import json
import os
from typing import Any

N_STEPS = 2


def install() -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    RayPPOTrainer.init_workers = _init_workers
    RayPPOTrainer.fit = _fit
    RayPPOTrainer._update_actor = _update_actor
    RayPPOTrainer._compute_old_log_prob = _compute_old_log_prob


def _init_workers(self: Any) -> None:  # no Ray worker groups, no GPUs
    self.actor_rollout_wg = None


def _step_batch(self: Any, batch_dict: dict, step: int) -> Any:
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    n = self.config.actor_rollout_ref.rollout.n
    batch = DataProto.from_single_dict(batch_dict).repeat(repeat_times=n, interleave=True)
    b = len(batch)
    batch.non_tensor_batch["uid"] = np.repeat(np.array([f"p{step}-{i}" for i in range(b // n)], dtype=object), n)
    g = torch.Generator().manual_seed(step)
    r = int(self.config.data.max_response_length)
    # verl 0.9.1's dataset leaves tokenization to the agent loop: the prompt ids come from the real tokenizer here
    p = int(self.config.data.max_prompt_length)
    texts = [" ".join(m["content"] for m in msgs) for msgs in batch.non_tensor_batch["raw_prompt"]]
    enc = [self.tokenizer.encode(t)[-p:] for t in texts]
    prompts = torch.full((b, p), int(self.tokenizer.pad_token_id))
    prompt_mask = torch.zeros(b, p, dtype=torch.long)
    for i, ids in enumerate(enc):  # left padded, as verl's prompts
        prompts[i, p - len(ids):] = torch.tensor(ids)
        prompt_mask[i, p - len(ids):] = 1
    batch.batch["prompts"] = prompts
    batch.batch["attention_mask"] = prompt_mask
    lengths = torch.randint(3, r + 1, (b,), generator=g)
    resp_mask = (torch.arange(r).unsqueeze(0) < lengths.unsqueeze(1)).long()
    response_mask = resp_mask.clone()
    response_mask[::2, 1] = 0  # a tool-result token in every other response
    scores = torch.zeros(b, r)
    scores[torch.arange(b), lengths - 1] = (torch.rand(b, generator=g) > 0.5).float()
    batch.batch["responses"] = torch.randint(5, 100, (b, r), generator=g)
    batch.batch["attention_mask"] = torch.cat([batch.batch["attention_mask"], resp_mask], 1)
    batch.batch["response_mask"] = response_mask
    batch.batch["old_log_probs"] = -torch.rand(b, r, generator=g) * 2
    batch.batch["token_level_scores"] = scores
    batch.batch["token_level_rewards"] = scores
    return compute_advantage(batch, adv_estimator=self.config.algorithm.adv_estimator, num_repeat=n,
                             config=self.config.algorithm)


def _fit(self: Any) -> None:
    from verl.utils.metric import reduce_metrics

    self.global_steps = 0
    for step, batch_dict in zip(range(1, N_STEPS + 1), self.train_dataloader, strict=False):
        self.global_steps = step
        batch = _step_batch(self, batch_dict, step)
        actor_output = self._update_actor(batch)
        metrics = reduce_metrics(actor_output.meta_info["metrics"])
        with open(os.environ["LLD_VERL_RAY_OUT"], "a") as f:
            f.write(json.dumps({"step": step, "trainer": type(self).__qualname__, "pid": os.getpid(),
                                "metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")


def _update_actor(self: Any, batch: Any) -> Any:  # what update_actor on the worker group returns
    from verl import DataProto

    return DataProto.from_single_dict(data={}, meta_info={"metrics": {"actor/pg_loss": [0.1], "actor/grad_norm": [1.0]}})


def _compute_old_log_prob(self: Any, batch: Any) -> tuple[Any, float]:  # post-update log-probs: every token fell
    from verl import DataProto

    return DataProto.from_dict(tensors={"old_log_probs": batch.batch["old_log_probs"] - 0.05}), 0.0
