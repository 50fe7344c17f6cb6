"""`lld-monitor import-wandb`: pull W&B runs into a store, online (wandb.Api) or from offline folders."""

from __future__ import annotations

import argparse
import json
import logging
import sys

HELP = "import Weights & Biases runs (online via the W&B API, or offline wandb/ folders) into a store"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lld_monitor.store import default_store_path
    from lld_monitor.store.schema import MODES

    parser.description = (
        "Import W&B runs into a store. Every scalar key lands in the metrics table; verl / Search-R1 and TRL "
        "names are mapped onto the step signals (docs/integrations.md). Re-importing a run replaces it. "
        "Online, the API key comes from the usual W&B places (WANDB_API_KEY, ~/.netrc, `wandb login`); it is "
        "never stored or printed, and there is deliberately no --api-key flag (it would land in shell history)."
    )
    parser.add_argument("--store", default=default_store_path(), metavar="PATH",
                        help="store: a folder or s3://bucket/prefix (default: $LLD_MONITOR_STORE, else ./lld_runs)")
    src = parser.add_argument_group("what to import (online: --entity and --project; or --offline)")
    src.add_argument("--entity", help="W&B entity (user or team)")
    src.add_argument("--project", help="W&B project")
    src.add_argument("--run", action="extend", nargs="+", default=[], metavar="ID",
                     help="W&B run id(s): --run A B, or --run A --run B (default: every run of the project)")
    src.add_argument("--offline", action="extend", nargs="+", default=[], metavar="PATH",
                     help="wandb/ folder(s), offline-run-* / run-* folder(s) or .wandb file(s), e.g. "
                          "--offline wandb/offline-run-* (a shell glob) or --offline A --offline B; no network")
    parser.add_argument("--mode", choices=list(MODES),
                        help="set the run mode by hand (default: inferred from the config, e.g. no_reduce_lambda > 0 -> llds)")
    parser.add_argument("--name", help="store name for the run (one offline run only; default: the W&B name)")
    parser.add_argument("--page-size", type=int, default=1000, help="history rows per API page (online)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary of what was imported")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from lld_monitor.integrations.wandb.importer import ImportError_, import_offline, import_online
    from lld_monitor.integrations.wandb.offline_file import NotAWandbFileError
    from lld_monitor.store import StoreError

    online = bool(args.entity or args.project or args.run)
    if not online and not args.offline:
        print("import-wandb: give --entity E --project P [--run ID ...] (online) or --offline DIR", file=sys.stderr)
        return 2
    if online and not (args.entity and args.project):
        print("import-wandb: online import needs both --entity and --project", file=sys.stderr)
        return 2
    results, missing, failed = [], [], {}
    try:
        for path in args.offline:
            results += import_offline(args.store, path, mode=args.mode, name=args.name,
                                      progress=not args.no_progress)
        if online:
            rep = import_online(args.store, args.entity, args.project, args.run or None, mode=args.mode,
                                page_size=args.page_size, progress=not args.no_progress)
            results += rep.imported
            missing, failed = rep.missing, rep.failed
    except (ImportError_, NotAWandbFileError, FileNotFoundError, StoreError) as exc:
        print(f"import-wandb: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"imported": [_summary(r) for r in results], "missing": missing, "failed": failed},
                         indent=2, default=str))
    else:
        for r in results:
            mapped = ", ".join(sorted(r.mapped)) or "none"
            print(f"{r.run_id}: {r.name!r} mode={r.mode} ({r.mode_reason}); {r.rows} rows, {r.steps} steps, "
                  f"{r.metric_values} values in {r.seconds:.2f} s ({r.rows_per_s:,.0f} rows/s); "
                  f"signals: {mapped}")
            for p in r.problems:
                print(f"  warning: {p}")
        for rid in missing:
            print(f"{rid}: not found on W&B (deleted or a wrong id); skipped", file=sys.stderr)
        for rid, err in failed.items():
            print(f"{rid}: failed: {err}", file=sys.stderr)
    return 0 if not failed and not missing else 1


def _summary(r) -> dict:
    return {
        "run_id": r.run_id, "name": r.name, "mode": r.mode, "mode_reason": r.mode_reason, "family": r.family,
        "rows": r.rows, "steps": r.steps, "metric_values": r.metric_values, "mapped": r.mapped,
        "skipped_keys": r.skipped_keys, "status": r.status, "seconds": round(r.seconds, 4),
        "rows_per_s": round(r.rows_per_s, 1), "problems": r.problems,
    }
