"""TRL `GRPOTrainer` with LLD signals (and optionally the LLDS / LLDS-MA term) — TRL 1.16.0.

The three lines a TRL user adds::

    from lld_monitor.integrations.trl import LLDGRPOTrainer           # 1. import
    trainer = LLDGRPOTrainer(model=..., reward_funcs=..., args=args,  # 2. instead of GRPOTrainer(...)
                             train_dataset=ds, lld_store="lld_runs")  #    (+ llds=LLDSConfig(lam=0.2) for LLDS)
    trainer.train()                                                   # 3. as before; the run is in lld_runs/

(or pass your own ``lld_logger=RunLogger(...)``). Then ``lld-monitor serve --store lld_runs``.

How it works (TRL 1.16.0 internals, pinned; `tests/test_integrations_trl.py` has a contract test):
- ``_compute_loss(model, inputs)`` is wrapped. During it, ``_get_per_token_logps_and_entropies(...,
  compute_entropy=True)`` is the policy forward of the loss; its ``(logps, entropies, aux)`` are captured
  (logps with their graph, for the LLDS term). The other calls (old / ref log-probs under no-grad) pass
  ``compute_entropy=False`` and are not captured.
- ``inputs`` holds ``completion_ids``, ``completion_mask`` (and ``tool_mask`` for tool calls),
  ``advantages`` [B] and ``old_per_token_logps`` — the latter only when the batch is reused
  (``num_iterations > 1``, or ``steps_per_generation > gradient_accumulation_steps``) or with vLLM.
  Otherwise TRL uses ``logps.detach()`` as the old log-probs and the within-step displacement is exactly 0:
  LLDS then never bites (a warning says so).
- ``_calculate_rewards`` and ``_generate_and_score_completions`` are wrapped to carry each completion's
  total reward and its group (prompt) through TRL's shuffle / split of the generation batch.
- Per optimizer step (at the micro-batch where ``accelerator.sync_gradients`` is True) the step's samples
  and tokens go to ``RunLogger.log_step``; TRL's own logged scalars (grad_norm, learning_rate, kl,
  clip ratios...) are added when TRL logs (``on_log``), mapped onto our signal names (mapping.py).

Step numbering: our step = TRL's ``state.global_step`` after the update (the step TRL logs under).
Displacement Δ = ln π_θ − ln π_old on the same completion tokens (negative = likelihood fell): with
``num_iterations = μ``, the first pass over a generation batch has Δ ≈ 0 and later passes show the drift.

LLDS option: ``llds=LLDSConfig(...)`` adds ``λ · L_LLDS / gradient_accumulation_steps`` to TRL's loss
(the same accumulation scaling TRL applies to its own policy loss), with ``L_LLDS`` from
:func:`lld_monitor.lld.llds_loss` on the captured log-probs. LLDS-MA (``answer_weight`` / ``adaptive_beta``)
needs the answer-tag token ids: ``answer_open_ids`` / ``answer_close_ids`` (e.g.
``tokenizer.encode("<answer>")``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers import TrainerCallback
from trl import GRPOTrainer

from lld_monitor import lld
from lld_monitor.aggregates import sample_sums_from_tokens
from lld_monitor.integrations import mapping
from lld_monitor.store.schema import ROLE_ACTION, ROLE_ANSWER, ROLE_TOOL, STEP_SIGNALS

log = logging.getLogger(__name__)

_SKIP_TRL_KEYS = frozenset({"epoch", "total_flos", "train_runtime", "train_samples_per_second",
                            "train_steps_per_second", "train_loss"})


def _pad_cat(tensors: list[Tensor], value: float) -> Tensor:
    t = max(x.shape[1] for x in tensors)
    out = [torch.nn.functional.pad(x, (0, t - x.shape[1]), value=value) if x.shape[1] < t else x for x in tensors]
    return torch.cat(out, dim=0)


class _LogCallback(TrainerCallback):
    def __init__(self, trainer: "LLDGRPOTrainer"):
        self.trainer = trainer

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: D401
        # training logs only: not the end-of-training summary, not evaluation
        if logs and "train_runtime" not in logs and not any(k.startswith("eval_") for k in logs):
            self.trainer._lld_on_trl_log(int(state.global_step), logs)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._lld_flush_pending()
        if self.trainer._lld_owns_logger and self.trainer.lld_logger is not None:
            self.trainer.lld_logger.close()


class LLDGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` that logs LLD signals per step into a run store, optionally with the LLDS term."""

    def __init__(
        self,
        *args: Any,
        lld_logger: Any = None,
        lld_store: str | None = None,
        lld_run_name: str | None = None,
        llds: lld.LLDSConfig | None = None,
        answer_open_ids: Sequence[int] | None = None,
        answer_close_ids: Sequence[int] | None = None,
        lld_token_every: int = 1,
        lld_token_groups: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.llds_cfg = llds
        if llds is not None and llds.masks_answer and not (answer_open_ids and answer_close_ids):
            raise ValueError("LLDS-MA (answer_weight / adaptive_beta) needs answer_open_ids and answer_close_ids "
                             "(the token ids of '<answer>' and '</answer>')")
        self.answer_open_ids = list(answer_open_ids or [])
        self.answer_close_ids = list(answer_close_ids or [])
        gen_every_reuse = self.num_iterations > 1 or self.args.steps_per_generation > self.args.gradient_accumulation_steps
        if llds is not None and not gen_every_reuse and not self.use_vllm:
            log.warning(
                "LLDS needs old log-probs that differ from the current ones: with num_iterations=1 and "
                "steps_per_generation <= gradient_accumulation_steps TRL uses logps.detach() as old log-probs, so "
                "the LLDS term is always 0. Set num_iterations > 1 (or steps_per_generation > grad-accum steps)."
            )
        self._lld_owns_logger = False
        if lld_logger is None and lld_store is not None:
            lld_logger = self._make_logger(lld_store, lld_run_name, lld_token_every, lld_token_groups)
            self._lld_owns_logger = True
        self.lld_logger = lld_logger
        self._lld_capture = False
        self._lld_stash: dict[str, Tensor | None] = {}
        self._lld_micro: list[dict[str, Tensor]] = []
        self._lld_pending: dict[int, tuple[dict, dict, dict]] = {}  # step -> (scalars, samples, tokens)
        self._lld_rewards_all: Tensor | None = None
        self.lld_last_term: float | None = None  # λ·L_LLDS/accum added to the last loss (for tests / inspection)
        self.add_callback(_LogCallback(self))

    # ----------------------------------------------------------------------------- logger
    def _make_logger(self, store: str, name: str | None, token_every: int, token_groups: int | None) -> Any:
        from lld_monitor.logger import RunLogger  # noqa: PLC0415

        if self.llds_cfg is None:
            mode = "vanilla"
        else:
            mode = "llds_ma" if self.llds_cfg.masks_answer else "llds"
        cfg = {k: v for k, v in self.args.to_dict().items() if isinstance(v, (int, float, str, bool)) or v is None}
        cfg["mode"] = mode
        if self.llds_cfg is not None:
            cfg["llds"] = dict(self.llds_cfg.__dict__)
        vocab = None
        tok = self.processing_class
        tok = getattr(tok, "tokenizer", tok)
        if hasattr(tok, "convert_ids_to_tokens"):
            try:
                vocab = [str(t) for t in tok.convert_ids_to_tokens(list(range(len(tok))))]
            except Exception:  # noqa: BLE001
                vocab = None
        model_name = getattr(getattr(self.model, "config", None), "_name_or_path", None) or type(self.model).__name__
        return RunLogger(
            store, name or f"trl-{self.args.run_name or 'grpo'}", mode, cfg, source="trl", model=model_name,
            rank=self.accelerator.process_index, world_size=self.accelerator.num_processes,
            token_every=token_every, token_groups=token_groups, vocab=vocab,
            run_id=None if self.accelerator.num_processes == 1 else self._shared_run_id(name),
        )

    def _shared_run_id(self, name: str | None) -> str:
        from lld_monitor.store.layout import new_run_id  # noqa: PLC0415
        from accelerate.utils import broadcast_object_list  # noqa: PLC0415

        obj = [new_run_id(name or "trl-grpo") if self.accelerator.is_main_process else None]
        broadcast_object_list(obj, from_process=0)
        return obj[0]

    # ----------------------------------------------------------------------------- TRL hooks
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._lld_rewards_all = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        n = out["completion_ids"].shape[0]
        device = out["completion_ids"].device
        start = self.accelerator.process_index * n
        rpf = self._lld_rewards_all
        if rpf is not None:
            w = self.reward_weights.to(rpf.device).unsqueeze(0)
            rewards = (rpf * w).nansum(dim=1)
            rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
            out["lld_reward"] = rewards[start : start + n].to(device).float()
        mode = "train" if self.model.training else "eval"
        g = self.num_generations if mode == "train" else self.num_generations_eval
        idx = torch.arange(start, start + n, device=device)
        out["lld_sample"] = idx
        out["lld_group"] = idx // max(int(g), 1)
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        res = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                         *args, **kwargs)
        if self._lld_capture and kwargs.get("compute_entropy"):
            self._lld_stash = {"logps": res[0], "entropies": res[1]}
        return res

    def _compute_loss(self, model, inputs):
        self._lld_stash = {}
        self._lld_capture = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._lld_capture = False
        logps = self._lld_stash.get("logps")
        if logps is None or not self.model.training:
            return loss
        mask = inputs["completion_mask"]
        tool = inputs.get("tool_mask")
        action = (mask * tool if tool is not None else mask).bool()
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        adv = inputs["advantages"]
        adv_r = adv[:, 0] if adv.dim() == 2 else adv
        answer = None
        if self.answer_open_ids and self.answer_close_ids:
            answer = lld.answer_span_mask(inputs["completion_ids"], action, self.answer_open_ids,
                                          self.answer_close_ids)
        llds_val = None
        if self.llds_cfg is not None:
            term, _ = lld.llds_loss(logps, old, adv_r, action, self.llds_cfg,
                                    answer_mask=answer if self.llds_cfg.masks_answer else None)
            scaled = self.llds_cfg.lam * term / self.current_gradient_accumulation_steps
            loss = loss + scaled
            self.lld_last_term = float(scaled.detach())
            llds_val = float(self.llds_cfg.lam * term.detach())
        if self.lld_logger is not None:
            self._lld_record(inputs, logps, old, adv_r, mask, tool, answer, llds_val)
            if self.accelerator.sync_gradients:
                self._lld_end_step()
        return loss

    # ----------------------------------------------------------------------------- per-step logging
    def _lld_record(self, inputs, logps, old, adv, mask, tool, answer, llds_val) -> None:
        ent = self._lld_stash.get("entropies")
        n = logps.shape[0]
        with torch.no_grad():
            role = torch.full_like(mask, ROLE_ACTION, dtype=torch.long)
            if tool is not None:
                role = torch.where(tool.bool(), role, torch.full_like(role, ROLE_TOOL))
            if answer is not None:
                role = torch.where(answer, torch.full_like(role, ROLE_ANSWER), role)
            rec = {
                "token_id": inputs["completion_ids"].detach().cpu(),
                "mask": mask.detach().bool().cpu(),
                "role": role.cpu(),
                "logp_new": logps.detach().float().cpu(),
                "logp_old": old.detach().float().cpu(),
                "advantage": adv.detach().float().cpu(),
                "reward": inputs.get("lld_reward", torch.full((n,), float("nan"))).detach().float().cpu(),
                "group": inputs.get("lld_group", torch.arange(n)).detach().cpu(),
            }
            if ent is not None:
                rec["entropy"] = ent.detach().float().cpu()
            ref = inputs.get("ref_per_token_logps")
            if ref is not None:
                rec["logp_ref"] = ref.detach().float().cpu()
            if llds_val is not None:
                rec["llds_loss"] = torch.tensor([llds_val])
        self._lld_micro.append(rec)

    def _lld_end_step(self) -> None:
        micro, self._lld_micro = self._lld_micro, []
        if not micro:
            return
        step = int(self.state.global_step) + 1  # the optimizer step this loss belongs to (TRL logs it as such)
        pad = {"token_id": 0, "mask": 0, "role": ROLE_ACTION, "logp_new": 0.0, "logp_old": 0.0, "entropy": 0.0,
               "logp_ref": 0.0}
        tok = {k: _pad_cat([m[k] for m in micro], pad[k]) for k in pad if k in micro[0]}
        mask = tok["mask"].bool()
        action = mask & (tok["role"] != ROLE_TOOL)
        tok["action_idx"] = lld.action_index(action)
        adv = torch.cat([m["advantage"] for m in micro])
        reward = torch.cat([m["reward"] for m in micro])
        scalars: dict[str, float] = {}  # Δ signals: RunLogger's step_aggregates over the samples' sums below
        if "entropy" in tok:
            scalars["entropy"] = float((tok["entropy"] * action).sum() / action.sum().clamp(min=1))
        llds_vals = [float(m["llds_loss"]) for m in micro if "llds_loss" in m]
        if llds_vals:
            scalars["llds_loss"] = float(np.mean(llds_vals))
        elif self.llds_cfg is None:
            scalars["llds_loss"] = 0.0
        groups = torch.cat([m["group"] for m in micro]).numpy()
        samples = {
            "reward": reward.numpy().astype(np.float64),
            "advantage": adv.numpy().astype(np.float64),
            "group_id": np.array([str(int(g)) for g in groups], dtype=object),
            "prompt_id": np.array([str(int(g)) for g in groups], dtype=object),
            "sample_idx": np.arange(len(groups), dtype=np.int32),
            "text": self._decode(tok["token_id"], mask),
            **sample_sums_from_tokens({k: tok[k] for k in ("mask", "role", "action_idx", "logp_old", "logp_new")}),
        }
        tokens = {k: v.numpy() for k, v in tok.items()}
        tokens["mask"] = tokens["mask"].astype(bool)
        # a step that TRL does not log (logging_steps > 1) goes out when the next one is ready
        self._lld_flush_pending(before=step)
        self._lld_pending[step] = (scalars, samples, tokens)

    def _decode(self, ids: Tensor, mask: Tensor) -> np.ndarray:
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        out = []
        for row, m in zip(ids.tolist(), mask.tolist(), strict=True):
            try:
                out.append(tok.decode([t for t, k in zip(row, m, strict=True) if k], skip_special_tokens=False))
            except Exception:  # noqa: BLE001
                out.append(None)
        return np.array(out, dtype=object)

    def _lld_on_trl_log(self, step: int, logs: dict[str, float]) -> None:
        extra: dict[str, float] = {}
        for k, v in logs.items():
            if k in _SKIP_TRL_KEYS or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            extra[k] = float(v)
        mapped = mapping.map_row(logs)
        scalars_trl: dict[str, float] = {}
        for k, v in extra.items():
            if k in STEP_SIGNALS:
                continue  # their meaning is decided by the mapping below
            scalars_trl[f"trl/{k}"] = v  # every TRL scalar, under its own name, in metrics
        for sig, v in mapped.items():
            scalars_trl[sig] = v
        if step in self._lld_pending:
            scalars, samples, tokens = self._lld_pending.pop(step)
            merged = {**scalars_trl, **scalars}  # our exact per-step figures win over TRL's window means
            for sig in ("grad_norm", "lr", "step_time", "kl", "clip_frac"):
                if sig in mapped:
                    merged[sig] = mapped[sig]
            self._lld_send(step, merged, samples, tokens)
        else:
            self._lld_send(step, scalars_trl, None, None)
        self._lld_flush_pending(before=step)

    def _lld_flush_pending(self, before: int | None = None) -> None:
        for s in sorted(self._lld_pending):
            if before is None or s < before:
                scalars, samples, tokens = self._lld_pending.pop(s)
                self._lld_send(s, scalars, samples, tokens)

    def _lld_send(self, step, scalars, samples, tokens) -> None:
        if self.lld_logger is None:
            return
        clean = {k: v for k, v in scalars.items() if v is not None}
        try:
            self.lld_logger.log_step(step, scalars=clean, samples=samples, tokens=tokens)
        except Exception:  # noqa: BLE001 - monitoring must never stop training
            log.exception("lld-monitor: could not log step %d", step)


__all__ = ["LLDGRPOTrainer"]
