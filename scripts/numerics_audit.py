"""Audit pinned numerics under gdb: what CPU-dispatched library code a pinned training step reaches.

    .venv/bin/python scripts/numerics_audit.py mkl                  # MKL and oneDNN calls in one pinned step
    .venv/bin/python scripts/numerics_audit.py vml-branches         # the run under each of MKL VML's code branches
    .venv/bin/python scripts/numerics_audit.py vml-branches --root /tmp/at-6bdab87   # ... of another checkout

`mkl` runs one step of the demo's vanilla run (scripts/spiral_config.json, the demo's seed) with a breakpoint
on every MKL function libtorch_cpu exports by its public name (VML's vs*/vms*/vd*/vmd*, VSL, CBLAS and BLAS,
DFTI), on MKL's CPU checks (mkl_serv_cpu_detect, mkl_vml_serv_cpu_detect, mkl_serv_intel_cpu_true) and on
oneDNN's primitive calls, and prints each function hit with the ATen kernel that called it. MKL and oneDNN
choose their code by CPU vendor and instruction set, so a pinned step must reach none of them (exit 1 if it
does).

`vml-branches` trains the first steps of that run once per code branch MKL's VML has for the functions ATen
calls (libtorch_cpu holds "EX", "E2", "L9" and "Z0" variants of each kernel; which one runs depends on the
CPU and on MKL_CBWR; an AMD EPYC runs EX), routing every VML kernel to that branch by a jump written at the
entry of its other branches, and prints each run's fingerprint. Where a pinned step calls VML, the fingerprints differ:
the run depends on the CPU. Where it calls none, they are one.

Needs gdb (Debian's `gdb`) and torch 2.13's libtorch_cpu.so (its symbol names); x86-64 Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MKL_API = re.compile(r"^(v[ms]?[sd][A-Z][A-Za-z0-9]*|cblas_[a-z0-9_]+|[sd](gemm|gemv|dot|axpy|scal|nrm2|ger|asum|copy|"
                     r"swap|trsm|syrk)_?|vsl[A-Za-z]+|Dfti[A-Za-z]+)$")
CPU_CHECKS = ("mkl_serv_cpu_detect", "mkl_vml_serv_cpu_detect", "mkl_serv_intel_cpu_true", "dnnl_primitive_create",
              "dnnl_primitive_execute", "dnnl_memory_create")
BRANCHES = ("EX", "E2", "L9", "Z0")

GDB_COUNT = r'''
import collections, re, gdb
NAMES = {names!r}
hits = collections.Counter()
armed = [False]
class Counter(gdb.Breakpoint):
    def stop(self):
        caller, frame = "?", gdb.newest_frame().older()
        for _ in range(8):
            if frame is None:
                break
            m = re.search(r"at::native::(?:AVX2::|DEFAULT::|AVX512::)?([A-Za-z0-9_]+)", frame.name() or "")
            if m:
                caller = m.group(1)
                break
            frame = frame.older()
        hits[(gdb.newest_frame().name(), caller)] += 1
        return False
def arm(event):
    if armed[0] or not any("libtorch_cpu" in (o.filename or "") for o in gdb.objfiles()):
        return
    armed[0] = True
    for n in NAMES:
        Counter(n, internal=True)
def report(event):
    gdb.write("AUDIT-BEGIN\n")
    for (fn, caller), k in hits.most_common():
        gdb.write(f"AUDIT {{k}} {{fn}} {{caller}}\n")
    gdb.write("AUDIT-END\n")
gdb.events.new_objfile.connect(arm)
gdb.events.exited.connect(report)
'''

GDB_ROUTE = r'''
import struct, gdb
KERNELS = {kernels!r}
TARGET = {target!r}
done = [False]
def arm(event):
    if done[0] or not any("libtorch_cpu" in (o.filename or "") for o in gdb.objfiles()):
        return
    done[0] = True
    inferior = gdb.selected_inferior()
    for name in KERNELS:  # every other branch of a kernel jumps to its TARGET branch
        branch = name[-len("EXHAynn"):-len("HAynn")]
        target = name[: -len("EXHAynn")] + TARGET + "HAynn"
        if branch == TARGET or target not in KERNELS:
            continue
        src = int(gdb.parse_and_eval(f"(long)&{{name}}"))
        dst = int(gdb.parse_and_eval(f"(long)&{{target}}"))
        inferior.write_memory(src, b"\xe9" + struct.pack("<i", dst - (src + 5)))  # jmp target
gdb.events.new_objfile.connect(arm)
'''


def libtorch_cpu() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).parent / "lib" / "libtorch_cpu.so"


def symbols(dynamic: bool) -> list[str]:
    out = subprocess.run(["nm", *(["-D", "--defined-only"] if dynamic else []), str(libtorch_cpu())],
                         capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if len(line.split()) == 3]


def train_command(root: Path, store: Path, steps: int) -> list[str]:
    sys.path.insert(0, str(root))
    from lld_monitor.commands.demo import DEMO_SEED, SPIRAL_CONFIG, trainer_command

    return trainer_command("vanilla", store, steps, DEMO_SEED, str(SPIRAL_CONFIG))


def under_gdb(script: str, cmd: list[str], root: Path) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(script)
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        res = subprocess.run(["gdb", "-q", "-batch", "-x", fh.name, "-ex", "run", "--args", *cmd], cwd=root, env=env,
                             capture_output=True, text=True, timeout=3600)
    finally:
        os.unlink(fh.name)
    if "exited normally" not in res.stdout + res.stderr:
        raise RuntimeError(f"the training under gdb failed:\n{(res.stdout + res.stderr)[-3000:]}")
    return res.stdout


def audit_mkl(root: Path) -> int:
    names = sorted({n for n in symbols(dynamic=True) if MKL_API.match(n) and not n.endswith("_64")} | set(CPU_CHECKS))
    with tempfile.TemporaryDirectory() as tmp:
        out = under_gdb(GDB_COUNT.format(names=names), train_command(root, Path(tmp) / "store", 1), root)
    calls = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("AUDIT ")]
    print(f"breakpoints on {len(names)} MKL/oneDNN functions; one pinned step of the demo's vanilla run:")
    for c in calls:
        count, fn, caller = c.split()
        print(f"  {int(count):6d} x {fn:28s} from ATen's {caller}")
    print("no MKL or oneDNN call" if not calls else f"{len(calls)} functions called")
    return 1 if calls else 0


def vml_branches(root: Path, steps: int) -> int:
    sys.path.insert(0, str(ROOT))
    from lld_monitor.store import open_store_reader
    from lld_monitor.store.compare import run_fingerprint

    kernels = sorted(n for n in symbols(dynamic=False) if re.match(r"^mkl_vml_kernel_[sd][A-Za-z0-9]+_(EX|E2|L9|Z0)HAynn$", n))
    prints = {}
    for branch in BRANCHES:
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store"
            under_gdb(GDB_ROUTE.format(kernels=kernels, target=branch), train_command(root, store, steps), root)
            with open_store_reader(store) as r:
                run = r.runs().run_id.iloc[0]
                prints[branch] = run_fingerprint(r, run, steps)
                first = r.steps(run).grad_norm.iloc[0]
        print(f"VML branch {branch}: fingerprint of {steps} steps {prints[branch][:16]}, step 0 grad_norm {first:.10f}")
    one = len(set(prints.values())) == 1
    print("one run whatever VML branch runs" if one else "the run depends on which VML branch runs")
    return 0 if one else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("mkl", "vml-branches"))
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose trainer runs (default: this one)")
    ap.add_argument("--steps", type=int, default=20, help="vml-branches: steps per run (default 20)")
    args = ap.parse_args()
    if shutil.which("gdb") is None:
        sys.exit("gdb is not installed (Debian: apt-get install gdb)")
    print(json.dumps({"root": str(args.root), "libtorch_cpu": str(libtorch_cpu())}))
    return audit_mkl(args.root.resolve()) if args.what == "mkl" else vml_branches(args.root.resolve(), args.steps)


if __name__ == "__main__":
    sys.exit(main())
