"""Launched by tests/test_integrations_trl_multiproc.py under `accelerate launch --cpu --num_processes 2` (not a
test module): two LLDGRPOTrainer runs with LLDS in one process group, (a) a RunLogger on the main process only,
(b) lld_store= on every process. Each process: per-device batch 2, 2 accumulation micro-batches per optimizer step,
steps_per_generation 2, num_iterations 2 (step 1 = first pass over the generation batch, step 2 = second pass)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import PartialState

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_integrations_trl import dataset, grpo_args, make_tokenizer, tiny_model  # noqa: E402

from lld_monitor import lld  # noqa: E402
from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer  # noqa: E402
from lld_monitor.logger import RunLogger  # noqa: E402

LLDS = lld.LLDSConfig(lam=0.3, norm="response", gate="token")  # token gate: some token of a preserved response falls


def reward_first_wrong(completions, **kwargs):
    """0 for the first completion of each process's batch (one group of 4 here), 1 for the others: 3 preserved
    responses per group, so the two micro-batches of 2 always hold 2 and 1 of them."""
    return [0.0] + [1.0] * (len(completions) - 1)


def main(root: Path) -> None:
    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    print(f"process {state.process_index} of {state.num_processes}, main={state.is_main_process}", flush=True)
    tok = make_tokenizer()

    def trainer(out: str, **kw) -> LLDGRPOTrainer:
        args = grpo_args(root / out, per_device_train_batch_size=2, num_generations=4, gradient_accumulation_steps=2,
                         steps_per_generation=2, num_iterations=2, max_steps=2, learning_rate=5e-2)
        return LLDGRPOTrainer(model=tiny_model(tok), reward_funcs=reward_first_wrong, args=args, train_dataset=dataset(),
                              processing_class=tok, llds=LLDS, **kw)

    # (a) a logger on the main process only
    logger = RunLogger(str(root / "store_main"), "main only", "llds", {}, source="trl", rank=0, world_size=2) \
        if state.is_main_process else None
    t = trainer("a", lld_logger=logger)
    t.train()
    if logger is not None:
        logger.close()
    print(f"rank {state.process_index}: main-only run done", flush=True)
    # (b) lld_store on every process
    t = trainer("b", lld_store=str(root / "store_all"), lld_run_name="every rank")
    t.train()
    print(f"rank {state.process_index}: every-rank run done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
