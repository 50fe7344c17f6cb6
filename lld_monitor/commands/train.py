"""`lld-monitor train`: the built-in Search-R1 GRPO trainer (vanilla / LLDS / LLDS-MA)."""

from __future__ import annotations

import argparse
import logging
import sys

from lld_monitor.store import default_store_path

HELP = "train a small Search-R1 agent with GRPO (vanilla | llds | llds-ma) and log it into a store"

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("vanilla", "llds", "llds-ma", "llds_ma"), default=None,
                   help="regularizer (default vanilla; llds_ma = llds-ma)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default 12)")
    p.add_argument("--seed", type=int, default=None, help="seed of prompts, sampling and the run (default 0)")
    p.add_argument("--store", default=default_store_path(),
                   help="run store: a folder, or s3://bucket/prefix with the AWS_* variables set (docs/store.md; default "
                   "$LLD_MONITOR_STORE or ./lld_runs)")
    p.add_argument("--run-name", default=None, help="run name (default '<mode>-seed<seed>')")
    p.add_argument("--model", default=None, help="a local Hugging Face causal LM directory instead of the tiny warm-started model")
    p.add_argument("--config", default=None, help="JSON or TOML file with config sections (see docs/backend.md)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="default auto (GPU if there is one)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1); used only with "
                   "\"deterministic\": false in the config: by default training runs on 1 thread so a seed is one run, bit-for-bit")
    p.add_argument("--numerics", choices=("pinned", "native"), default=None,
                   help="pinned (default): the same seed and config give the same run on any x86-64 CPU with AVX2; "
                   "native: this CPU's fastest kernels, another run on another CPU (docs/backend.md, Reproducibility)")
    p.add_argument("--corpus", default=None, help="JSONL corpus for BM25 instead of the generated world")
    p.add_argument("--retriever-url", default=None, help="Search-R1 style /retrieve URL instead of local BM25")
    p.add_argument("--run-id", default=None, help="explicit run id (default: derived from the name and the time)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from lld_monitor.backend.config import load_config

    try:
        cfg = load_config(
            args.config, mode=args.mode, steps=args.steps, seed=args.seed, model_path=args.model, device=args.device,
            threads=args.threads, numerics=args.numerics, corpus=args.corpus, retriever_url=args.retriever_url,
        )
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"lld-monitor train: bad config: {e}", file=sys.stderr)
        return 2
    name = args.run_name or f"{cfg.mode}-seed{cfg.seed}"
    from lld_monitor.backend import numerics

    numerics.require(cfg.numerics)  # before the trainer (and so torch) is imported: pinned kernels are chosen at load
    from lld_monitor.store import StoreError
    from lld_monitor.store.location import is_bucket

    if is_bucket(args.store):  # a wrong key or bucket is said now, not after the warm start
        from lld_monitor.store.bucket import Bucket
        from lld_monitor.store.storedir import open_bucket_store_for_write

        try:
            open_bucket_store_for_write(Bucket(args.store))
        except StoreError as e:
            print(f"lld-monitor train: {e}", file=sys.stderr)
            return 2
    from lld_monitor.backend.grpo import Trainer

    try:
        trainer = Trainer(cfg, args.store, name, progress=not args.no_progress, run_id=args.run_id)
    except (StoreError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"lld-monitor train: {e}", file=sys.stderr)
        return 2
    try:
        run_id = trainer.train()
    except StoreError as e:  # the store refused the run (it exists, another writer took it over, ...)
        print(f"lld-monitor train: {e}", file=sys.stderr)
        return 2
    if trainer.dist.rank == 0:
        print(f"run {run_id} ({name}) written to {args.store}")
    if trainer.dist.enabled:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0
