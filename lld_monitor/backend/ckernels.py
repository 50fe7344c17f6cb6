"""The C kernels of pinned numerics, built once per machine and loaded through ctypes.

One shared library holds both sources:
- `matmul.c`: matrix products in a fixed summation order (used by `matmul.py`);
- `elementwise.c`: exp, log, sin, cos and sqrt as fixed sequences of IEEE operations (used by `elementwise.py`).

The library is compiled with the system C compiler into the user cache, keyed by the sources and the flags
(`scripts/setup.sh` builds it ahead of time: `python -m lld_monitor.backend.ckernels`). The flags carry the
numerics: `-ffp-contract=off` (the compiler fuses or reorders nothing; the intrinsics and the written
operations are the arithmetic), no `-ffast-math`, and `-fno-math-errno` (a square root is the one instruction).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from lld_monitor.files import atomic_write, user_cache_dir

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("matmul.c"), Path(__file__).with_name("elementwise.c"))
CFLAGS = ("-O2", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-std=gnu11", "-shared", "-fPIC")
ISA_ENV = "LLD_MATMUL_ISA"  # "avx2": never use matmul's AVX-512 kernel (same bits, for tests and comparisons)
ELEMENTWISE = ("exp", "log", "sin", "cos", "sqrt")


class KernelUnavailable(RuntimeError):
    """The C kernels cannot run here (no AVX2/FMA, or no C compiler to build them)."""


def cpu_supports_kernel() -> bool:
    """True when the CPU has AVX2 and FMA (read from /proc/cpuinfo; False where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx2" in flags and "fma" in flags


def library_path() -> Path:
    """Where this machine's build of the kernels lives (keyed by the sources and the flags)."""
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return user_cache_dir() / "kernels" / f"lld-kernels-{digest}.so"


def build(force: bool = False) -> Path:
    """Compile the kernels into the user cache (once; an atomic rename makes concurrent builds safe)."""
    out = library_path()
    if out.is_file() and not force:
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler found (cc/gcc) to build the pinned-numerics kernels; install gcc, "
                                "or train with numerics 'native' (not reproducible across CPUs)")

    def compile_to(tmp: str) -> None:
        res = subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
        if res.returncode != 0:
            raise KernelUnavailable(f"building {', '.join(s.name for s in SOURCES)} with {cc} failed:\n"
                                    f"{res.stderr[-2000:]}")

    atomic_write(out, compile_to, suffix=".so")
    log.info("built the pinned-numerics kernels: %s", out)
    return out


@functools.lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """The loaded library, its functions typed; `lib().isa` is the matmul kernel it runs."""
    if not cpu_supports_kernel():
        raise KernelUnavailable("this CPU lacks AVX2/FMA, which the pinned-numerics kernels need; train with "
                                "numerics 'native' (not reproducible across CPUs)")
    so = ctypes.CDLL(str(build()))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    so.lld_bmm.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64, i64]
    so.lld_bmm.restype = ctypes.c_int
    so.lld_pack_b.argtypes = [ptr, i64, i64, i64, i64, ptr]
    so.lld_pack_b.restype = None
    so.lld_packed_size.argtypes = [i64, i64]
    so.lld_packed_size.restype = i64
    so.lld_gemm_packed.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64]
    so.lld_gemm_packed.restype = None
    so.lld_select_isa.argtypes = [ctypes.c_int]
    so.lld_select_isa.restype = ctypes.c_int
    for name in ELEMENTWISE:
        for dtype in ("f32", "f64"):
            fn = getattr(so, f"lld_{name}_{dtype}")
            fn.argtypes = [ptr, ptr, i64]
            fn.restype = None
    so.isa = {1: "avx2", 2: "avx512"}[so.lld_select_isa(int(os.environ.get(ISA_ENV, "") == "avx2"))]
    log.debug("pinned-numerics kernels loaded (matmul: %s)", so.isa)
    return so


def available() -> bool:
    """True when the kernels can be loaded (built first if needed)."""
    try:
        lib()
        return True
    except KernelUnavailable as e:
        log.debug("pinned-numerics kernels unavailable: %s", e)
        return False


if __name__ == "__main__":  # `python -m lld_monitor.backend.ckernels`: build the kernels now (scripts/setup.sh)
    logging.basicConfig(level=logging.INFO)
    print(build(), lib().isa)
