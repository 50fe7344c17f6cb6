"""`lld-monitor runs`: list the runs of a store (table, or the public JSON contract with --json)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

HELP = "list the runs in a store (name, mode, source, status, steps, last step, last update)"

#: the public `runs --json` fields, in order (docs/store.md); more may be added, none renamed
JSON_FIELDS = ("run_id", "name", "mode", "source", "status", "steps", "last_step", "started_at", "ended_at",
               "updated_at", "model", "world_size", "schema_version", "numerics")


def _numerics(config: Any) -> str | None:
    """The built-in trainer's numerics (pinned | native) from a run's config; None for other runs."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    value = config.get("numerics") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lld_monitor.store import default_store_path

    parser.add_argument("--store", default=default_store_path(), metavar="PATH",
                        help="store: a folder or s3://bucket/prefix (default: $LLD_MONITOR_STORE, else ./lld_runs)")
    parser.add_argument("--json", action="store_true", help='print {"runs": [...]} (a stable public contract)')


def _jsonable(v: Any) -> Any:
    if v is None:
        return None
    if hasattr(v, "isoformat"):
        try:
            import pandas as pd

            if v is pd.NaT:
                return None
        except ImportError:
            pass
        return v.isoformat()
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def runs_json(store: str) -> dict[str, Any]:
    """The `runs --json` document for a store (raises StoreError subclasses on bad stores)."""
    import pandas as pd

    from lld_monitor.store import open_store_reader

    r = open_store_reader(store)
    try:
        df = r.runs()
    finally:
        r.close()
    out = []
    for rec in df.to_dict(orient="records"):
        row = {}
        rec["numerics"] = _numerics(rec.get("config"))
        for k in JSON_FIELDS:
            v = rec.get(k)
            row[k] = None if (v is pd.NA or v is pd.NaT or (isinstance(v, float) and math.isnan(v))) else _jsonable(v)
        out.append(row)
    return {"runs": out}


def run(args: argparse.Namespace) -> int:
    from lld_monitor.store import StoreError

    try:
        doc = runs_json(args.store)
    except StoreError as e:
        print(f"lld-monitor runs: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc, ensure_ascii=False, indent=2))
        return 0
    rows = doc["runs"]
    if not rows:
        print(f"no runs in {args.store}")
        return 0
    cols = ("name", "mode", "source", "status", "steps", "last_step", "numerics", "updated_at", "run_id")
    table = [[("" if r[c] is None else str(r[c])) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
    return 0
