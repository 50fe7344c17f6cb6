"""An op trace of pinned training: every ATen op of a short `lld-monitor train` run with a hash of its output,
to find the first op whose bits differ between two CPUs (`scripts/golden_fingerprint.py --trace / --diff-trace`).

`record` trains the run twice in this process under a `TorchDispatchMode` and writes one JSON line per op
output: {"i", "op", "shape", "dtype", "sha", "in"}, "sha" being the first 16 hex digits of SHA-256 over the
output's bytes and "in" the same over the op's first floating-point input (the C kernels are called through
ctypes, not ATen, so their results show up as the next op's input). Hashes that differ between the two runs
on one machine (uninitialized memory before the warm start loads) are marked "noise" and never compared.
The format is that of the trace in `tests/op_traces/`, so a trace taken on one CPU can be diffed against one
taken on another at the same commit. Call `record` in a fresh process: pinned numerics need their kernels
chosen before torch loads.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import tempfile
from pathlib import Path

# ops whose output is uninitialized memory: never compared
UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_"}


# torch and the trainer are imported inside the functions: `record` pins the numerics environment first
def _sha(t) -> str | None:
    import torch

    t = t.detach()
    if t.is_sparse or not t.is_floating_point() and t.dtype not in (torch.int64, torch.int32, torch.bool):
        return None
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def _trace_one_run(config: Path, seed: int, mode: str, steps: int, store: str) -> list[dict]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from lld_monitor.backend.config import load_config
    from lld_monitor.backend.grpo import Trainer

    rows: list[dict] = []

    class Trace(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.__name__.split(".")[0]
            # an in-place op's self is about to be overwritten (and may be uninitialized): hash the others
            ins = args[1:] if name.endswith("_") and not name.endswith("__") else args
            first_in = next((a for a in tree_leaves(ins) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            in_sha = _sha(first_in) if first_in is not None else None
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    rows.append({"i": Trace.calls, "op": str(func), "shape": list(t.shape), "dtype": str(t.dtype),
                                 "sha": None if name in UNINITIALIZED else _sha(t), "in": in_sha})
            Trace.calls += 1
            return out

    with Trace():
        cfg = load_config(config, mode=mode, seed=seed, steps=steps)
        Trainer(cfg, store, "trace", progress=False).train()
    return rows


def record(out: Path, config: Path, seed: int, mode: str = "vanilla", steps: int = 1) -> tuple[int, int]:
    """Trace `steps` pinned steps of (config, seed, mode) twice; write the trace to `out` (gzip JSON lines).
    Returns (op outputs written, hashes marked noise)."""
    from lld_monitor.backend import numerics

    numerics.require("pinned")  # before the trainer (and torch) loads
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(2):  # what differs between two runs on one machine (uninitialized memory) is noise
            runs.append(_trace_one_run(config, seed, mode, steps, f"{tmp}/store{k}"))
    a, b = runs
    if [(r["op"], r["shape"]) for r in a] != [(r["op"], r["shape"]) for r in b]:
        raise RuntimeError("two runs on this machine ran different op sequences: the trace cannot be compared")
    noise = 0
    with gzip.open(out, "wt") as fh:
        for ra, rb in zip(a, b):
            for key in ("sha", "in"):
                if ra[key] != rb[key]:
                    ra[key] = "noise"
                    noise += 1
            fh.write(json.dumps(ra) + "\n")
    return len(a), noise


def diff(a: Path, b: Path) -> str | None:
    """The first op whose output (or input) bits differ between two traces, with the ops just before it, in
    words; None when the traces agree on every hash that is not noise."""
    before: list[str] = []
    n = 0
    with gzip.open(a, "rt") as fa, gzip.open(b, "rt") as fb:
        for n, (la, lb) in enumerate(zip(fa, fb)):
            ra, rb = json.loads(la), json.loads(lb)
            before = (before + [f"  #{ra['i']} {ra['op']} {ra['shape']}"])[-8:]
            if ra["op"] != rb["op"] or ra["shape"] != rb["shape"]:
                return f"line {n}: the op sequences part: {ra['op']} {ra['shape']} vs {rb['op']} {rb['shape']}"
            differs = [k for k in ("in", "sha") if "noise" not in (ra[k], rb[k]) and ra[k] != rb[k]]
            if differs:
                where = "input" if differs[0] == "in" else "output"
                return "\n".join([f"line {n} (op #{ra['i']}): first difference, in the {where} of {ra['op']} "
                                  f"{ra['shape']} {ra['dtype']}",
                                  "the ops just before it (the last one is the first that differs):", *before])
    return None
