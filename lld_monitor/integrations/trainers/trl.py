"""TRL `GRPOTrainer` with LLD signals (and optionally the LLDS / LLDS-MA term) — TRL 1.16.0.

The three lines a TRL user adds::

    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer           # 1. import
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
  ``advantages`` [B] and ``old_per_token_logps`` — the latter only when
  ``gradient_accumulation_steps % (steps_per_generation · num_iterations) != 0`` or with vLLM's
  importance-sampling correction (TRL's own rule, :func:`old_logps_are_kept`). Otherwise TRL uses
  ``logps.detach()`` as the old log-probs and the displacement is exactly 0: LLDS then never bites (a
  warning at construction says so).
- :func:`check_trl_internals` runs at construction: a TRL whose internals moved raises
  :class:`UnsupportedTRLError` naming the supported range; a loss whose policy forward was not captured
  raises too, so the LLDS term can never silently disappear.
- Tool calls (``tools=``, or ``rollout_func`` + ``env_mask``): ``tool_mask`` = 0 tokens are role "tool", out of
  the LLDS term and every likelihood figure; :func:`tool_call_counts` (tool-result blocks per completion)
  fills ``samples.n_searches`` / ``searches_per_response`` and gives adaptive LLDS-MA its V (the generation
  batch mean over all ranks).
- Several processes: whether anything is logged is decided on every rank together at construction, so the
  gathers run on every rank even when a logger exists on the main process only (a gather on a subset of the
  processes hangs). The step row is computed from every rank's samples (gathered), entropy and the LLDS value
  from every rank's sums. ``lld_store=`` on every rank: each writes its samples / tokens into one run (rank 0's
  run id is broadcast); on the main process only: its samples / tokens and the all-rank step row. The store
  path must be one that every process writing to it can reach (multi-node: a shared filesystem, or log on the
  main process only).
- ``_calculate_rewards`` and ``_generate_and_score_completions`` are wrapped to carry each completion's
  total reward and its group (prompt) through TRL's shuffle / split of the generation batch.
- Per optimizer step (at the micro-batch where ``accelerator.sync_gradients`` is True) the step's samples
  and tokens go to ``RunLogger.log_step``; TRL's own logged scalars (grad_norm, learning_rate, kl,
  clip ratios...) are added when TRL logs (``on_log``), mapped onto our signal names (`signals.map_row`).

Step numbering: our step = TRL's ``state.global_step`` after the update (the step TRL logs under).
Displacement Δ = ln π_θ − ln π_old on the same completion tokens (negative = likelihood fell): with
``num_iterations = μ``, the first pass over a generation batch has Δ ≈ 0 and later passes show the drift.

LLDS option: ``llds=LLDSConfig(...)`` adds λ · L_LLDS of the optimizer step's whole batch (every micro-batch of
the accumulation window on every process) to TRL's loss, spread over the micro-batches: each adds
``num_processes · λ · llds_loss(micro-batch, normalizer=N)`` with N the window's global denominator
(:func:`lld_monitor.lld.llds_normalizer`, counted when the generation batch is split, summed over processes),
so the micro-batch terms add up to the window's value whatever the micro-batch size (DDP averages over
processes). When a window spans two generation batches (``steps_per_generation · num_iterations`` not a
multiple of ``gradient_accumulation_steps``) N is not known in time: then ``λ · L_LLDS(micro-batch) /
gradient_accumulation_steps`` (a warning says so). ``L_LLDS`` comes from :func:`lld_monitor.lld.llds_loss` on
the captured log-probs.

Noise gate: a micro-batch whose old log-probs were computed by the current parameters (no optimizer step since its
generation batch was scored: the first pass with ``num_iterations`` > 1, or every pass with vLLM's
importance-sampling correction and ``gradient_accumulation_steps % (steps_per_generation · num_iterations) == 0``)
has Δ = recomputation noise; the LLDS gradient does not shrink with |Δ|, so it would push up whichever tokens the
noise lowered at full λ. Such micro-batches, and any whose max |Δ| is at or below ``llds_noise_floor``, get no
LLDS term (``llds_skip_on_policy=True``, default), a warning (once) and the step metric ``llds_noise_gated``. LLDS-MA (``answer_weight`` / ``adaptive_beta``)
needs the answer-tag token ids: ``answer_open_ids`` / ``answer_close_ids`` (e.g.
``tokenizer.encode("<answer>")``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import trl
from torch import Tensor
from transformers import TrainerCallback
from trl import GRPOTrainer

from lld_monitor import lld
from lld_monitor.payload import authors_scalars, step_payload, tool_runs
from lld_monitor.signals import map_row
from lld_monitor.store.schema import STEP_SIGNALS

log = logging.getLogger(__name__)

_SKIP_TRL_KEYS = frozenset({"epoch", "total_flos", "train_runtime", "train_samples_per_second",
                            "train_steps_per_second", "train_loss"})


SUPPORTED_TRL = "trl>=1.16,<1.17"  # the internals below are checked by check_trl_internals() at construction


class UnsupportedTRLError(RuntimeError):
    """The installed TRL does not have the internals LLDGRPOTrainer hooks into."""


def check_trl_internals(cls: type = GRPOTrainer) -> None:
    """Raise UnsupportedTRLError unless the TRL internals the log-prob capture relies on are present, so the
    capture (and the LLDS term) can never silently do nothing after a TRL upgrade."""
    problems: list[str] = []
    try:
        params = list(inspect.signature(cls._get_per_token_logps_and_entropies).parameters)
        if params[:5] != ["self", "model", "input_ids", "attention_mask", "logits_to_keep"] or \
                "compute_entropy" not in params:
            problems.append(f"_get_per_token_logps_and_entropies{tuple(params)}")
        if list(inspect.signature(cls._compute_loss).parameters) != ["self", "model", "inputs"]:
            problems.append("_compute_loss(self, model, inputs)")
        src = inspect.getsource(cls._compute_loss)
        for needle in ("compute_entropy=True", 'inputs["completion_mask"]', 'inputs["advantages"]',
                       "old_per_token_logps"):
            if needle not in src:
                problems.append(f"_compute_loss no longer contains {needle!r}")
        for name, want in (("_calculate_rewards", ["self", "inputs", "prompts", "completions", "completion_ids_list"]),
                           ("_generate_and_score_completions", ["self", "inputs"]),
                           ("_prepare_inputs", ["self", "generation_batch"])):
            if list(inspect.signature(getattr(cls, name)).parameters) != want:
                problems.append(f"{name}{tuple(want)}")
        # the LLDS normalizer follows TRL's buffering: one chunk per micro-step, regenerated every spg·μ steps
        if "self._buffered_inputs[self._step % self.args.steps_per_generation]" not in inspect.getsource(
                cls._prepare_inputs):
            problems.append("_prepare_inputs no longer returns _buffered_inputs[_step % steps_per_generation]")
    except (AttributeError, OSError, TypeError) as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    if problems:
        raise UnsupportedTRLError(
            f"lld-monitor's TRL hook supports {SUPPORTED_TRL}; the installed trl {trl.__version__} changed the "
            f"internals it captures log-probs from ({'; '.join(problems)}). Install a supported TRL "
            f"(pip install '{SUPPORTED_TRL}') or upgrade lld-monitor."
        )


def old_logps_are_kept(args: Any, num_iterations: int, use_vllm: bool, vllm_is_correction: bool) -> bool:
    """TRL 1.16's own rule (`_generate_and_score_completions`): old log-probs are computed only when
    ``gradient_accumulation_steps % (steps_per_generation · num_iterations) != 0`` or with vLLM's
    importance-sampling correction; otherwise `_compute_loss` uses ``logps.detach()`` and Δ ≡ 0."""
    generate_every = args.steps_per_generation * num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or (use_vllm and vllm_is_correction)


def llds_sees_only_noise(args: Any, num_iterations: int, use_vllm: bool, vllm_is_correction: bool) -> bool:
    """True when TRL keeps old log-probs only for vLLM's importance-sampling correction and every micro-batch is
    consumed before the next optimizer step (``gradient_accumulation_steps % (steps_per_generation ·
    num_iterations) == 0``): the old log-probs are then always the current parameters' and Δ is noise."""
    generate_every = args.steps_per_generation * num_iterations
    return bool(use_vllm and vllm_is_correction and args.gradient_accumulation_steps % generate_every == 0)


def tool_call_counts(completion_mask: Tensor, tool_mask: Tensor | None) -> Tensor:
    """Tool calls per completion [B]: the number of tool-result blocks (runs of tool_mask = 0 inside the
    completion mask). With TRL's `tools=` each executed call appends one result block; with `rollout_func`
    each `env_mask` = 0 run is one environment reply."""
    if tool_mask is None:
        return torch.zeros(completion_mask.shape[0], device=completion_mask.device)
    return tool_runs(completion_mask, completion_mask.bool() & tool_mask.bool()).float()


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
        llds_skip_on_policy: bool = True,
        llds_noise_floor: float = lld.NOISE_FLOOR,
        **kwargs: Any,
    ):
        check_trl_internals()
        super().__init__(*args, **kwargs)
        self.llds_cfg = llds
        if llds is not None and llds.masks_answer and not (answer_open_ids and answer_close_ids):
            raise ValueError("LLDS-MA (answer_weight / adaptive_beta) needs answer_open_ids and answer_close_ids "
                             "(the token ids of '<answer>' and '</answer>')")
        self.answer_open_ids = list(answer_open_ids or [])
        self.answer_close_ids = list(answer_close_ids or [])
        if not llds_noise_floor >= 0:
            raise ValueError(f"llds_noise_floor must be >= 0 (0 = gate only on-policy micro-batches), got {llds_noise_floor}")
        self.lld_skip_on_policy = llds_skip_on_policy
        self.lld_noise_floor = float(llds_noise_floor)
        vllm_is = getattr(self, "vllm_importance_sampling_correction", False)
        self.lld_old_logps_kept = old_logps_are_kept(self.args, self.num_iterations, self.use_vllm, vllm_is)
        if llds is not None and llds_sees_only_noise(self.args, self.num_iterations, self.use_vllm, vllm_is):
            log.warning(
                "TRL computes old log-probs here only for vLLM's importance-sampling correction, and with "
                "gradient_accumulation_steps=%d, steps_per_generation=%d, num_iterations=%d every micro-batch is used "
                "before the next optimizer step: the old log-probs are the current policy's and Δ is recomputation "
                "noise. %s Use num_iterations > 1 (or steps_per_generation > gradient_accumulation_steps) for LLDS "
                "to see a displacement.", self.args.gradient_accumulation_steps, self.args.steps_per_generation,
                self.num_iterations, "LLDS is skipped on every micro-batch (llds_skip_on_policy)."
                if llds_skip_on_policy else "LLDS acts on that noise at full λ (llds_skip_on_policy=False).")
        generate_every = self.args.steps_per_generation * self.num_iterations
        self._lld_exact_norm = generate_every % self.args.gradient_accumulation_steps == 0
        if llds is not None and self.lld_old_logps_kept and not self._lld_exact_norm:
            log.warning("gradient_accumulation_steps=%d does not divide steps_per_generation*num_iterations=%d: an "
                        "optimizer step spans two generation batches, so the LLDS term is normalized per "
                        "micro-batch (λ·L_LLDS/gradient_accumulation_steps), not by the step's global count",
                        self.args.gradient_accumulation_steps, generate_every)
        if not self.lld_old_logps_kept:
            log.warning(
                "TRL keeps no old log-probs with gradient_accumulation_steps=%d, steps_per_generation=%d, "
                "num_iterations=%d (it needs gradient_accumulation_steps %% (steps_per_generation*num_iterations) "
                "!= 0, or vLLM importance-sampling correction): it uses logps.detach(), so the displacement is "
                "exactly 0%s. Change one of the three.",
                self.args.gradient_accumulation_steps, self.args.steps_per_generation, self.num_iterations,
                " and the LLDS term is always 0" if llds is not None else "",
            )
        # decided on every rank together: the gathers below must run on all processes or on none
        self._lld_active, any_store = self._lld_collective_flags(lld_logger is not None, lld_store is not None)
        run_id = self._shared_run_id(lld_run_name) if any_store and self.accelerator.num_processes > 1 else None
        self._lld_owns_logger = False
        if lld_logger is None and lld_store is not None:
            lld_logger = self._make_logger(lld_store, lld_run_name, lld_token_every, lld_token_groups, run_id)
            self._lld_owns_logger = True
        self.lld_logger = lld_logger
        self._lld_chunk_counts: list[float] | None = None
        self._lld_warned_noise = False
        self._lld_capture = False
        self._lld_stash: dict[str, Tensor | None] = {}
        self._lld_micro: list[dict[str, Tensor]] = []
        self._lld_pending: dict[int, tuple[dict, dict, dict]] = {}  # step -> (scalars, samples, tokens)
        self._lld_all: dict[int, dict[str, np.ndarray]] = {}  # step -> every rank's sample columns (several ranks)
        self._lld_rewards_all: Tensor | None = None
        self.lld_last_term: float | None = None  # λ·L_LLDS/accum added to the last loss (for tests / inspection)
        self.add_callback(_LogCallback(self))

    # ----------------------------------------------------------------------------- logger
    def _lld_collective_flags(self, has_logger: bool, has_store: bool) -> tuple[bool, bool]:
        """(does any rank log, does any rank use lld_store), the same answer on every rank."""
        if self.accelerator.num_processes == 1:
            return has_logger or has_store, has_store
        from accelerate.utils import gather_object  # noqa: PLC0415

        flags = gather_object([(has_logger, has_store)])
        if any(st for _, st in flags) and not (flags[0][1] or flags[0][0]):
            raise ValueError("lld_store= is given on a non-main process but the main process has neither lld_store "
                             "nor lld_logger: pass lld_store= on the main process too (it writes the run and the "
                             "step rows)")
        if any(st for _, st in flags) and flags[0][0] and not flags[0][1]:
            raise ValueError("lld_store= on other processes needs lld_store= (not lld_logger=) on the main process, "
                             "so that they join the same run")
        return any(lg or st for lg, st in flags), any(st for _, st in flags)

    def _make_logger(self, store: str, name: str | None, token_every: int, token_groups: int | None,
                     run_id: str | None = None) -> Any:
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
            token_every=token_every, token_groups=token_groups, vocab=vocab, run_id=run_id,
        )

    def _shared_run_id(self, name: str | None) -> str:
        from accelerate.utils import broadcast_object_list  # noqa: PLC0415

        from lld_monitor.store.layout import new_run_id  # noqa: PLC0415

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
        calls = tool_call_counts(out["completion_mask"], out.get("tool_mask"))
        # V for adaptive β: mean tool calls per completion over the whole generation batch (all ranks);
        # a 0-dim tensor survives TRL's shuffle / split of the batch unchanged
        out["lld_tool_calls_mean"] = self.accelerator.gather(calls.float()).mean()
        idx = torch.arange(start, start + n, device=device)
        out["lld_sample"] = idx
        out["lld_group"] = idx // max(int(g), 1)
        # the optimizer steps done when the old log-probs were computed (0-dim: survives the shuffle / split)
        out["lld_gen_step"] = torch.tensor(int(self.state.global_step), device=device)
        return out

    def _prepare_inputs(self, generation_batch):
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.llds_cfg is None or not self.model.training:
            return inputs
        if self._buffered_inputs is not before:  # a new generation batch, split into steps_per_generation chunks
            self._lld_chunk_counts = self._lld_count_chunks(self._buffered_inputs)
        n = self._lld_window_normalizer()
        return inputs if n is None else {**inputs, "lld_llds_normalizer": torch.tensor(n)}

    def _lld_count_chunks(self, chunks: list[dict]) -> list[float]:
        """Each chunk's LLDS denominator (lld.llds_normalizer), summed over processes (all regenerate together)."""
        counts = []
        for c in chunks:
            action = c["completion_mask"] if c.get("tool_mask") is None else c["completion_mask"] * c["tool_mask"]
            counts.append(float(lld.llds_normalizer(c["advantages"], action, self.llds_cfg.norm)))
        t = torch.tensor(counts, dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            t = self.accelerator.gather(t.to(self.accelerator.device)).cpu().view(-1, len(counts)).sum(dim=0)
        return t.tolist()

    def _lld_window_normalizer(self) -> float | None:
        """The LLDS denominator of the accumulation window of the current micro-step (every micro-batch of the
        optimizer step, every process), or None when the window spans a generation batch not made yet."""
        if not self._lld_exact_norm or self._lld_chunk_counts is None:
            return None
        ga, spg = self.args.gradient_accumulation_steps, self.args.steps_per_generation
        first = (self._step // ga) * ga
        return float(sum(self._lld_chunk_counts[j % spg] for j in range(first, first + ga)))

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
        if not self.model.training:
            return loss
        if logps is None:
            # the policy forward was not captured: never train or log as if LLDS were applied
            raise UnsupportedTRLError(
                f"lld-monitor captured no policy log-probs in _compute_loss (installed trl {trl.__version__}; "
                f"supported {SUPPORTED_TRL}). Install a supported TRL or upgrade lld-monitor."
            )
        mask = inputs["completion_mask"]
        tool = inputs.get("tool_mask")
        action = (mask * tool if tool is not None else mask).bool()
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        adv_r = lld.response_advantages(inputs["advantages"], action.shape[0], action)
        answer = None
        if self.answer_open_ids and self.answer_close_ids:
            answer = lld.answer_span_mask(inputs["completion_ids"], action, self.answer_open_ids,
                                          self.answer_close_ids)
        llds_val = None
        gated = False
        calls = tool_call_counts(mask, tool)
        if self.llds_cfg is not None:
            v_mean = None
            if self.llds_cfg.adaptive_beta is not None:
                # V = mean tool calls per completion of the generation batch this micro-batch came from
                v_mean = float(inputs["lld_tool_calls_mean"]) if "lld_tool_calls_mean" in inputs else float(
                    calls.mean())
            world = self.accelerator.num_processes
            norm_t = inputs.get("lld_llds_normalizer")
            term, st = lld.llds_loss(logps, old, adv_r, action, self.llds_cfg,
                                     answer_mask=answer if self.llds_cfg.masks_answer else None,
                                     valid_searches_mean=v_mean,
                                     normalizer=None if norm_t is None else float(norm_t))
            # this micro-batch's share of the optimizer step's λ·L_LLDS (over every micro-batch and process)
            share = self.llds_cfg.lam * term
            if norm_t is None:
                share = share / (self.current_gradient_accumulation_steps * world)
            gated = self._lld_noise_gated(inputs, logps, old, action, st)
            if gated:
                self.lld_last_term = 0.0
                llds_val = 0.0
            else:
                scaled = share * world  # DDP averages the gradients over the processes
                loss = loss + scaled
                self.lld_last_term = float(scaled.detach())
                llds_val = float(share.detach())
        if self._lld_active:
            self._lld_record(inputs, logps, old, adv_r, mask, action, answer, llds_val, calls, gated)
            if self.accelerator.sync_gradients:
                self._lld_end_step()
        return loss

    def _lld_noise_gated(self, inputs, logps, old, action, st) -> bool:
        """No LLDS term on a micro-batch whose Δ is recomputation noise (see the module docstring)."""
        same_policy = (inputs.get("old_per_token_logps") is not None and "lld_gen_step" in inputs
                       and int(inputs["lld_gen_step"]) == int(self.state.global_step))
        d_max = lld.max_abs_displacement(logps, old, action)
        gated = (self.lld_skip_on_policy and same_policy) or d_max <= self.lld_noise_floor
        if gated and st["n_penalized_tokens"] > 0 and inputs.get("old_per_token_logps") is not None \
                and not self._lld_warned_noise:
            log.warning("lld-monitor LLDS: no term on a micro-batch whose old log-probs %s (max |Δ| = %.3g): Δ is "
                        "recomputation noise, and LLDS would push up whichever tokens the noise lowered at full λ. "
                        "Logged per step as llds_noise_gated.",
                        "come from the current parameters" if same_policy else
                        f"are within llds_noise_floor={self.lld_noise_floor:g}", d_max)
            self._lld_warned_noise = True
        return gated

    # ----------------------------------------------------------------------------- per-step logging
    def _lld_record(self, inputs, logps, old, adv, mask, action, answer, llds_val, calls, gated=False) -> None:
        """Keep this micro-batch's tensors for the step's log (CPU copies; concatenated at the step's end)."""
        ent = self._lld_stash.get("entropies")
        n = logps.shape[0]
        with torch.no_grad():
            rec = {
                "token_ids": inputs["completion_ids"].detach().cpu(),
                "valid_mask": mask.detach().bool().cpu(),
                "model_mask": action.detach().bool().cpu(),
                "answer_mask": (answer if answer is not None else torch.zeros_like(action)).detach().bool().cpu(),
                "logp_new": logps.detach().float().cpu(),
                "logp_old": old.detach().float().cpu(),
                "advantages": adv.detach().float().cpu(),
                "rewards": inputs.get("lld_reward", torch.full((n,), float("nan"))).detach().float().cpu(),
                "group": inputs.get("lld_group", torch.arange(n)).detach().cpu(),
                "calls": calls.detach().cpu(),
            }
            if ent is not None:
                rec["entropy"] = ent.detach().float().cpu()
            ref = inputs.get("ref_per_token_logps")
            if ref is not None:
                rec["logp_ref"] = ref.detach().float().cpu()
            if llds_val is not None:
                rec["llds_loss"] = torch.tensor([llds_val])
                rec["llds_gated"] = torch.tensor([float(gated)])
        self._lld_micro.append(rec)

    def _lld_end_step(self) -> None:
        micro, self._lld_micro = self._lld_micro, []
        if not micro:
            return
        step = int(self.state.global_step) + 1  # the optimizer step this loss belongs to (TRL logs it as such)
        per_token = ("token_ids", "valid_mask", "model_mask", "answer_mask", "logp_new", "logp_old", "entropy",
                     "logp_ref")
        tok = {k: _pad_cat([m[k] for m in micro], 0) for k in per_token if k in micro[0]}
        groups = torch.cat([m["group"] for m in micro])
        payload = step_payload(**tok, advantages=torch.cat([m["advantages"] for m in micro]),
                               rewards=torch.cat([m["rewards"] for m in micro]), group_ids=groups,
                               n_searches=torch.cat([m["calls"] for m in micro]),
                               texts=self._decode(tok["token_ids"], tok["valid_mask"]))
        action = tok["model_mask"]
        llds_vals = [float(m["llds_loss"]) for m in micro if "llds_loss" in m]
        gated = [float(m["llds_gated"]) for m in micro if "llds_gated" in m]
        # entropy as sums and counts, the LLDS shares and gates as sums, added over every rank (one step row)
        parts = torch.tensor([
            float((tok["entropy"] * action).sum()) if "entropy" in tok else 0.0, float(action.sum()),
            float(np.sum(llds_vals)), float(len(llds_vals)), float(np.sum(gated)),
        ], dtype=torch.float64)
        parts = self._lld_gather(parts).view(-1, 5).sum(dim=0)
        scalars: dict[str, float] = {}  # Δ signals: RunLogger's step_aggregates over the samples' sums
        if "entropy" in tok:
            scalars["entropy"] = float(parts[0] / parts[1].clamp(min=1))
        if llds_vals:
            scalars["llds_loss"] = float(parts[2])  # λ·L_LLDS of the step: the sum of every micro-batch's share
            scalars["llds_noise_gated"] = float(parts[4] / parts[3])
        elif self.llds_cfg is None:
            scalars["llds_loss"] = 0.0
        # the LLDS authors' own metrics, on this process's samples (theirs come from data-parallel rank 0 too)
        scalars.update(authors_scalars(model_mask=action, logp_old=tok["logp_old"],
                                       advantages=torch.cat([m["advantages"] for m in micro]),
                                       logp_ref=tok.get("logp_ref"), answer_mask=tok["answer_mask"],
                                       logp_now=tok["logp_new"]))
        if self.accelerator.num_processes > 1:
            # the step row is computed (by rank 0's logger) from every rank's samples, not rank 0's alone
            self._lld_all[step] = self._lld_gather_samples(payload.samples, groups)
        # a step that TRL does not log (logging_steps > 1) goes out when the next one is ready
        self._lld_flush_pending(before=step)
        self._lld_pending[step] = (scalars, payload.samples, payload.tokens)

    def _lld_gather(self, t: Tensor) -> Tensor:
        """Concatenate a 1-D tensor over ranks (every rank calls this at the same optimizer step)."""
        if self.accelerator.num_processes == 1:
            return t
        return self.accelerator.gather(t.to(self.accelerator.device)).cpu()

    def _lld_gather_samples(self, samples: dict[str, Any], groups: Tensor) -> dict[str, np.ndarray]:
        """The numeric sample columns of every rank (TRL gives each rank the same number of samples per step)."""
        out: dict[str, np.ndarray] = {}
        for k, v in samples.items():
            if isinstance(v, np.ndarray) and v.dtype != object:
                out[k] = self._lld_gather(torch.as_tensor(v.astype(np.float64))).numpy().astype(v.dtype)
        out["group_id"] = np.array([str(int(g)) for g in self._lld_gather(groups.long()).tolist()], dtype=object)
        return out

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
        mapped = map_row(logs)
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
        # scalars are the main process's to log (its logger writes the step row); other ranks send samples / tokens
        clean = {k: v for k, v in scalars.items() if v is not None} if self.accelerator.is_main_process else {}
        try:
            self.lld_logger.log_step(step, scalars=clean, samples=samples, tokens=tokens,
                                     all_samples=self._lld_all.pop(step, None))
        except Exception:  # noqa: BLE001 - monitoring must never stop training
            log.exception("lld-monitor: could not log step %d", step)


__all__ = ["SUPPORTED_TRL", "LLDGRPOTrainer", "UnsupportedTRLError", "check_trl_internals", "llds_sees_only_noise",
           "old_logps_are_kept", "tool_call_counts"]
