"""The trainer's numerics: `pinned` (the default) gives the same bits for a seed and config on any x86-64 CPU
with AVX2 and FMA; `native` lets torch pick the fastest kernels of this CPU (and so another run on another CPU).

What `pinned` fixes, and why each (docs/backend.md, "Reproducibility"):
- `ATEN_CPU_CAPABILITY=avx2`: ATen compiles each vectorized kernel (softmax, exp, reductions, ...) for
  several instruction sets and picks one by the CPU at start-up: AVX-512 on one machine, AVX2 on the next,
  with other lane widths and so other rounding. Forcing its AVX2 build runs the same code on every AVX2
  CPU (it uses no approximate instruction whose result differs between vendors: `objdump` of
  libtorch_cpu finds rcpps/rsqrtps only in MKL's code).
- `MKL_CBWR=COMPATIBLE`: MKL dispatches by CPU vendor and instruction set; its COMPATIBLE branch (SSE2
  without rcpps/rsqrtps) is the one Intel documents for Intel and compatible CPUs alike. What MKL still
  computes for the built-in model is small (the reference model of an HF checkpoint runs through it).
- the built-in model's matrix products go through `matmul.py`'s fixed-order kernel instead of MKL: the
  same bits everywhere at 2-3x the speed of MKL's COMPATIBLE branch, and the same bits whatever batch
  a row is in.
- torch's exp, log, sqrt, sin and cos go through `elementwise.py`'s kernels instead of MKL's VML, which
  picks its code by CPU vendor and ignores `MKL_CBWR` on AMD (`require` installs them for the process).
- the retriever ranks by exact BM25 scores, ties broken by document index (`retriever.py`): numpy picks
  its SIMD code by CPU, and bm25s's top-k left the order of tied documents to it.
- one torch thread (`TrainConfig.deterministic`, as before).

Both environment variables are read once, when torch and MKL load, so they must be set before the first
`import torch`: `lld-monitor train` and every launcher built on it (`demo`, `torchrun -m lld_monitor.cli`,
`scripts/run_spiral_experiment.py`) set them first thing; `Trainer` sets them when torch is not loaded yet
and refuses to start a pinned run when it is loaded without them.
"""

from __future__ import annotations

import os
import sys

NUMERICS = ("pinned", "native")
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}


class NumericsError(RuntimeError):
    """A pinned run was asked for in a process whose torch already loaded with other kernels."""


def check_name(numerics: str) -> str:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    return numerics


def pin_environment() -> None:
    """Set the pinned kernels' environment variables, if torch has not loaded yet (else see `require`)."""
    if "torch" not in sys.modules:
        os.environ.update(PINNED_ENV)


def pinned_in_effect() -> bool:
    """True when this process's torch runs the pinned kernels (env set before torch loaded)."""
    if any(os.environ.get(k) != v for k, v in PINNED_ENV.items()):
        return False
    if "torch" not in sys.modules:
        return True  # they will be when it loads
    import torch  # already loaded (checked above): this module itself never loads it

    # ATen read ATEN_CPU_CAPABILITY at load; AVX2 is also what a CPU without AVX-512 runs anyway
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def require(numerics: str) -> None:
    """Make `numerics` hold in this process, or raise NumericsError saying how to launch it."""
    check_name(numerics)
    if numerics == "native":
        return
    pin_environment()
    if not pinned_in_effect():
        env = " ".join(f"{k}={v}" for k, v in PINNED_ENV.items())
        raise NumericsError(
            "pinned numerics (the same run on every CPU) need their kernels chosen before torch loads, and torch "
            f"was imported first in this process. Launch with `lld-monitor train`, or set {env} before importing "
            "torch (call lld_monitor.backend.numerics.pin_environment() first thing), or use numerics 'native' "
            "(this CPU's fastest kernels; another CPU gives another run)."
        )
    # imported here, not at the top: it loads torch, which must come after the environment above
    from .elementwise import install

    install()


def numpy_avx512_targets() -> list[str]:
    """numpy's SIMD targets above AVX2 that this CPU runs: with them in `NPY_DISABLE_CPU_FEATURES`, numpy runs
    the code it runs on a CPU without AVX-512 (the tests check that a pinned run does not change)."""
    import numpy as np  # here: this module stays importable without numpy (config checks)

    core = np._core._multiarray_umath
    return [t for t in core.__cpu_dispatch__ if t != "X86_V3" and core.__cpu_features__.get(t)]


def cpu_model() -> str:
    """The CPU's model name as `lscpu` prints it (what figures about floats or speed name), else "unknown CPU"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
