"""verl driver hook: every PPO step's samples and tokens (post-update log-probs included) into a run store.

`LLDRayPPOTrainer` subclasses verl's `RayPPOTrainer` (verl 0.9.1, legacy trainer ``trainer.use_v1=False``)
and overrides the actor-update step: after verl's update it runs one extra ``compute_log_prob`` on the same
batch (the post-update ln π on the *same* tokens, so Δ = ln π_after − ln π_before is the paper's
displacement), then ``RunLogger.log_step`` with responses, masks, old / new log-probs, advantages, scores and
uids. Tool / observation tokens (``attention_mask = 1`` but ``response_mask = 0`` on the response side) are
stored with role "tool" and left out of every likelihood figure.

Run verl through it (same Hydra overrides as ``python -m verl.trainer.main_ppo``)::

    python -m lld_monitor.integrations.trainers.verl_hook trainer.use_v1=False +trainer.lld_store=lld_runs ...

How the trainer gets into the Ray actor: verl builds ``RayPPOTrainer`` inside ``TaskRunner.run``, a Ray actor
method. Ray ships an actor class that is not importable by name *by value* (cloudpickle; verl's ``TaskRunner`` name
is bound to the Ray wrapper, not the class), and a function shipped by value reads a private copy of its module
globals, so setting ``main_ppo_v0.RayPPOTrainer`` on the driver, or in a subclass shipped by value, never reaches
it. :class:`LLDTaskRunner` is a plain module-level class (Ray ships it by reference, the worker imports this
module); in the worker it rebinds ``RayPPOTrainer`` in the globals of verl's ``TaskRunner.run`` as imported
there, then runs it. It checks that verl's ``run`` still reads that name (else :class:`UnsupportedVerlError`),
and the trainer says in the worker's log that it is active.

The extra ``compute_log_prob`` pass is one more forward pass of the actor over the step's batch (docs/integrations.md
states its cost). It runs inside verl's ``timing_s/update_actor`` timer, and is logged on its own as
``timing_s/lld_post_update_log_prob`` with ``perf/lld_post_update_log_prob_share`` = its time / the time of
verl's update alone (both in verl's metrics and in the run store).

Bypass mode (``algorithm.rollout_correction.bypass_mode=true``) sets ``old_log_probs = rollout_log_probs``:
Δ then measures the rollout-engine / trainer mismatch plus the update, not LLD alone; the run's config says
so (``lld_bypass_mode``) and a warning is logged.

Search-R1's older ``RayPPOTrainer.fit()`` has no ``_update_actor``; add the same two lines after its
``actor_output = self.actor_rollout_wg.update_actor(batch)``::

    new = self.actor_rollout_wg.compute_log_prob(batch).batch["old_log_probs"]
    log_verl_step(logger, self.global_steps, batch, new, tokenizer=self.tokenizer)

Tested on CPU: verl's real ``run_ppo`` → Ray actor → ``TaskRunner.run`` builds this trainer and it writes rows
(tests/test_integrations_verl_ray.py; worker groups and the generation loop stubbed); not run here: GPUs, a rollout
engine (vLLM / SGLang), several nodes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from verl import DataProto
from verl.trainer import main_ppo_v0
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from lld_monitor import lld
from lld_monitor.payload import StepPayload, authors_scalars, step_payload

log = logging.getLogger(__name__)

TIMING_KEY = "timing_s/lld_post_update_log_prob"
SHARE_KEY = "perf/lld_post_update_log_prob_share"


class UnsupportedVerlError(RuntimeError):
    """The installed verl does not build its trainer where the hook puts LLDRayPPOTrainer."""


def _cfg_get(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def is_bypass_mode(config: Any) -> bool:
    """verl's bypass mode: old_log_probs = rollout_log_probs (Δ is then not LLD alone)."""
    return bool(_cfg_get(config, "algorithm.rollout_correction.bypass_mode", False))


def on_policy_share(config: Any) -> float:
    """The share of a step's actor mini-batch updates that see the parameters old_log_probs came from:
    1 / (ppo_epochs × train_batch_size / ppo_mini_batch_size). On those, Δ inside the loss is recomputation noise."""
    train = float(_cfg_get(config, "data.train_batch_size", 1) or 1)
    mini = float(_cfg_get(config, "actor_rollout_ref.actor.ppo_mini_batch_size", train) or train)
    epochs = float(_cfg_get(config, "actor_rollout_ref.actor.ppo_epochs", 1) or 1)
    return 1.0 / max(epochs * max(train / mini, 1.0), 1.0)


def verl_step_payload(batch: DataProto, new_log_probs: Tensor, tokenizer: Any = None) -> StepPayload:
    """The step of a verl batch and its post-update log-probs [B, R], as RunLogger takes it (`payload.py`), with the
    LLDS authors' metrics of the batch as its scalars (`payload.authors_scalars`)."""
    b = batch.batch
    responses = b["responses"]
    n, r = responses.shape
    valid = b["attention_mask"][:, -r:].bool()  # every real response token (model and tool)
    model = (b["response_mask"].bool() if "response_mask" in b.keys() else valid) & valid  # model tokens only
    old = b["old_log_probs"].float()
    if new_log_probs.shape != old.shape:
        raise ValueError(f"post-update log-probs must be [B, R] = {tuple(old.shape)}, got {tuple(new_log_probs.shape)}")
    if "token_level_scores" in b.keys():
        reward = b["token_level_scores"].float().sum(dim=-1)
    else:
        reward = torch.full((n,), float("nan"))
    uid = batch.non_tensor_batch.get("uid")
    texts = None
    if tokenizer is not None:
        texts = [tokenizer.decode(row[m].tolist(), skip_special_tokens=False)
                 for row, m in zip(responses.cpu(), valid.cpu(), strict=True)]
    ref = b["ref_log_prob"].float() if "ref_log_prob" in b.keys() else None
    adv = lld.response_advantages(b["advantages"].float(), n, model)  # [B, R] tiled: at the first model token
    return step_payload(
        token_ids=responses, valid_mask=valid, model_mask=model, logp_old=old, logp_new=new_log_probs,
        logp_ref=ref, advantages=adv, rewards=reward, group_ids=list(uid) if uid is not None else range(n), texts=texts,
        scalars=authors_scalars(model_mask=model, logp_old=old, advantages=adv, logp_ref=ref),
    )


def log_verl_step(logger: Any, step: int, batch: DataProto, new_log_probs: Tensor, tokenizer: Any = None,
                  scalars: Mapping[str, float] | None = None) -> None:
    """One verl PPO step into `logger` (a RunLogger): samples, tokens and any extra scalars."""
    payload = verl_step_payload(batch, new_log_probs, tokenizer)
    logger.log_step(int(step), scalars={**payload.scalars, **dict(scalars or {})}, samples=payload.samples,
                    tokens=payload.tokens)


class LLDRayPPOTrainer(RayPPOTrainer):
    """`RayPPOTrainer` that logs each step's samples / tokens (with post-update log-probs) to a run store.

    The store is ``trainer.lld_store`` in the verl config (default ``lld_runs``); pass ``lld_logger=`` to use
    your own RunLogger."""

    def __init__(self, *args: Any, lld_logger: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lld_logger = lld_logger
        self._lld_owns_logger = lld_logger is None
        self.lld_bypass = is_bypass_mode(self.config)
        log.warning("lld-monitor: LLDRayPPOTrainer is the trainer; each step's samples and tokens go to store %s",
                    _cfg_get(self.config, "trainer.lld_store", "lld_runs") if lld_logger is None else "(your logger)")
        if self.lld_bypass:
            log.warning("verl bypass mode: old_log_probs are the rollout engine's, so the displacement lld-monitor "
                        "logs measures the rollout / trainer mismatch plus the update, not LLD alone")
        if _cfg_get(self.config, "actor_rollout_ref.actor.policy_loss.loss_mode") == "llds":
            share = on_policy_share(self.config)
            if share >= 1.0:
                log.warning("lld-monitor LLDS: one mini-batch and one epoch per step, so every actor update is "
                            "on-policy: inside the loss Δ is recomputation noise and LLDS has nothing to preserve "
                            "(the noise gate llds_noise_floor skips it where |Δ| is below the floor). Use "
                            "ppo_mini_batch_size < train_batch_size or ppo_epochs > 1 for LLDS to act.")
            else:
                log.info("lld-monitor LLDS: %.0f%% of the actor mini-batch updates are on-policy (Δ = noise there)",
                         100 * share)

    def _lld_logger(self) -> Any:
        if self.lld_logger is None:
            from lld_monitor.logger import RunLogger  # noqa: PLC0415

            store = _cfg_get(self.config, "trainer.lld_store", "lld_runs")
            mode = "llds" if _cfg_get(self.config, "actor_rollout_ref.actor.policy_loss.loss_mode") == "llds" else "vanilla"
            name = _cfg_get(self.config, "trainer.experiment_name", "verl")
            self.lld_logger = RunLogger(store, str(name), mode, {"lld_bypass_mode": self.lld_bypass}, source="verl",
                                        model=_cfg_get(self.config, "actor_rollout_ref.model.path"))
        return self.lld_logger

    def _update_actor(self, batch: DataProto) -> DataProto:
        t0 = time.perf_counter()
        out = super()._update_actor(batch)
        t_update = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            new, _ = self._compute_old_log_prob(batch)  # after the update: ln π_new on the same tokens
            t_extra = time.perf_counter() - t1
            timing = {TIMING_KEY: t_extra, SHARE_KEY: t_extra / t_update if t_update > 0 else float("nan")}
            metrics = out.meta_info.setdefault("metrics", {})
            metrics.update(timing)  # verl reduces and logs them with the actor's metrics
            scalars = {"verl_bypass_mode": 1.0} if self.lld_bypass else {}
            log_verl_step(self._lld_logger(), self.global_steps, batch, new.batch["old_log_probs"],
                          getattr(self, "tokenizer", None), {**scalars, **timing})
        except Exception:  # noqa: BLE001 - monitoring must never stop training
            log.exception("lld-monitor: could not log verl step %s", getattr(self, "global_steps", "?"))
        return out

    def fit(self) -> Any:
        """verl's fit; then the run is closed as finished (crashed if fit raised), before Ray tears the actor down."""
        try:
            out = super().fit()
        except BaseException:
            self._lld_close("crashed")
            raise
        self._lld_close("finished")
        return out

    def _lld_close(self, status: str) -> None:
        if self._lld_owns_logger and self.lld_logger is not None:
            try:
                self.lld_logger.close(status)
            except Exception:  # noqa: BLE001
                log.exception("lld-monitor: could not close the run")


def install_trainer(run: Any) -> None:
    """Make verl's ``TaskRunner.run`` (the function object Ray actually runs) build LLDRayPPOTrainer: rebind the
    name in *its* globals (a copy when Ray shipped the class by value, verl's module dict otherwise)."""
    fn = getattr(run, "__func__", run)
    if "RayPPOTrainer" not in getattr(fn, "__code__", None).co_names:
        raise UnsupportedVerlError(
            "verl's TaskRunner.run no longer builds RayPPOTrainer by that name, so lld-monitor's verl hook cannot "
            "put its trainer there (supported: verl 0.9.1 with trainer.use_v1=False). Log from your own trainer "
            "with lld_monitor.integrations.trainers.verl_hook.log_verl_step instead."
        )
    fn.__globals__["RayPPOTrainer"] = LLDRayPPOTrainer


class LLDTaskRunner:
    """The Ray actor that runs verl's legacy ``TaskRunner.run`` with LLDRayPPOTrainer as the trainer.

    A plain module-level class, not a subclass of verl's TaskRunner: Ray ships it by reference (the worker imports
    this module), and verl's TaskRunner is imported *in the worker* and run there, so nothing of verl's is shipped
    by value (a by-value copy of verl's methods reads copied globals and, for ``super()``, a copied class)."""

    def run(self, config: Any) -> Any:
        base = main_ppo_v0.TaskRunner.__ray_actor_class__  # verl's class, from the worker's own import
        install_trainer(base.run)
        return base().run(config)


def task_runner() -> Any:
    """The Ray actor class to pass as verl's ``run_ppo(config, task_runner_class=...)``."""
    import ray  # noqa: PLC0415

    return ray.remote(num_cpus=1)(LLDTaskRunner)


def main() -> None:  # pragma: no cover - needs Ray and GPUs
    """`python -m lld_monitor.integrations.trainers.verl_hook <verl Hydra overrides>`: verl's main_ppo with the hook."""
    import os  # noqa: PLC0415

    import hydra  # noqa: PLC0415
    import verl  # noqa: PLC0415
    from verl.trainer.main_ppo import run_ppo  # noqa: PLC0415

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")

    # under `python -m` this file is __main__, whose classes Ray would ship by value: take the named module's
    import importlib  # noqa: PLC0415

    hook = importlib.import_module("lld_monitor.integrations.trainers.verl_hook")

    @hydra.main(config_path=config_dir, config_name="ppo_trainer", version_base=None)
    def _main(config: Any) -> None:
        run_ppo(config, task_runner_class=hook.task_runner())

    _main()


if __name__ == "__main__":  # pragma: no cover
    main()


__all__ = ["SHARE_KEY", "TIMING_KEY", "LLDRayPPOTrainer", "LLDTaskRunner", "UnsupportedVerlError", "install_trainer",
           "is_bypass_mode", "log_verl_step", "on_policy_share", "task_runner", "verl_step_payload"]
