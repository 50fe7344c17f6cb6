"""Matrix products in a fixed summation order (`matmul.c`), for the built-in model's pinned numerics.

Every output element is one chain of fused multiply-adds over k = 0 .. K-1, so its bits depend on its own
row and column only: the same on every x86-64 CPU with AVX2 and FMA, and the same whatever batch a row is
in. MKL's GEMM gives neither (its code path follows the CPU and the matrix sizes), and its one
CPU-independent branch (`MKL_CBWR=COMPATIBLE`, SSE2) runs at about a quarter of its AVX-512 speed. Where
the CPU has AVX-512 the kernel computes twice the columns at once, by the same chains, so with the same
bits (`LLD_MATMUL_ISA=avx2` keeps the AVX2 kernel; the tests compare the two).

The C source is compiled once per machine with the system C compiler into the user cache (`scripts/setup.sh`
does it ahead of time) and called through ctypes. `matmul` and `linear` carry autograd; their backward
products go through the same kernel. A weight is packed once per value (a parameter's `_version` moves
with every in-place update), which is what makes the rollout's many one-token products cheap.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils.weak import WeakTensorKeyDictionary

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("matmul.c")
# -ffp-contract=off: the compiler may not fuse or reorder anything; the intrinsics are the arithmetic.
# The vector kernels carry their own target attributes (AVX2+FMA, AVX-512F), picked at run time.
CFLAGS = ("-O2", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11", "-shared", "-fPIC")
ISA_ENV = "LLD_MATMUL_ISA"  # "avx2": never use the AVX-512 kernel (same bits, for tests and comparisons)


class KernelUnavailable(RuntimeError):
    """The fixed-order kernel cannot run here (no AVX2/FMA, or no C compiler to build it)."""


def cpu_supports_kernel() -> bool:
    """True when the CPU has AVX2 and FMA (read from /proc/cpuinfo; False where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx2" in flags and "fma" in flags


def library_path() -> Path:
    """Where this machine's build of the kernel lives (keyed by the source and the flags)."""
    from .sft import user_cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return user_cache_dir() / "kernels" / f"matmul-{digest}.so"


def build(force: bool = False) -> Path:
    """Compile the kernel into the user cache (once; an atomic rename makes concurrent builds safe)."""
    out = library_path()
    if out.is_file() and not force:
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler found (cc/gcc) to build the fixed-order matmul kernel; install gcc, "
                                "or train with numerics 'native' (not reproducible across CPUs)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".matmul-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if res.returncode != 0:
            raise KernelUnavailable(f"building {SOURCE.name} with {cc} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
        log.info("built the fixed-order matmul kernel: %s", out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    if not cpu_supports_kernel():
        raise KernelUnavailable("this CPU lacks AVX2/FMA, which the fixed-order matmul kernel needs; train with "
                                "numerics 'native' (not reproducible across CPUs)")
    lib = ctypes.CDLL(str(build()))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.lld_bmm.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64, i64]
    lib.lld_bmm.restype = ctypes.c_int
    lib.lld_pack_b.argtypes = [ptr, i64, i64, i64, i64, ptr]
    lib.lld_pack_b.restype = None
    lib.lld_packed_size.argtypes = [i64, i64]
    lib.lld_packed_size.restype = i64
    lib.lld_gemm_packed.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64]
    lib.lld_gemm_packed.restype = None
    lib.lld_select_isa.argtypes = [ctypes.c_int]
    lib.lld_select_isa.restype = ctypes.c_int
    lib.isa = {1: "avx2", 2: "avx512"}[lib.lld_select_isa(int(os.environ.get(ISA_ENV, "") == "avx2"))]
    log.debug("fixed-order matmul: %s kernel", lib.isa)
    return lib


def available() -> bool:
    """True when the kernel can be loaded (built first if needed)."""
    try:
        _lib()
        return True
    except KernelUnavailable as e:
        log.debug("fixed-order matmul unavailable: %s", e)
        return False


def isa() -> str:
    """The kernel this process runs: 'avx512' or 'avx2' (the same bits either way)."""
    return _lib().isa


def _check(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"fixed-order matmul: {name} must be a float32 CPU tensor, got {x.dtype} on {x.device}")


def pack(b: torch.Tensor) -> torch.Tensor:
    """B [K, N] (any strides) packed for `lld_gemm_packed`: 16-column panels, k-major, zero-padded."""
    _check(b, "b")
    k, n = b.shape
    out = torch.empty(_lib().lld_packed_size(k, n), dtype=torch.float32)
    _lib().lld_pack_b(b.data_ptr(), b.stride(0), b.stride(1), k, n, out.data_ptr())
    return out


# packed weights, per parameter and orientation: (version, packed). Weak keys: a dropped model frees them.
_PACKED = WeakTensorKeyDictionary()


def _packed_weight(w: torch.Tensor, transpose: bool) -> torch.Tensor:
    """`pack(w.t())` or `pack(w)`, reused until w changes (its `_version` moves with every in-place update)."""
    slot = _PACKED.setdefault(w, {})
    hit = slot.get(transpose)
    if hit is not None and hit[0] == w._version:
        return hit[1]
    packed = pack(w.detach().t() if transpose else w.detach())
    slot[transpose] = (w._version, packed)
    return packed


def _gemm_packed(a: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """a [M, K] @ packed B [K, n] -> [M, n]."""
    _check(a, "a")
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, k = a.shape
    out = torch.empty((m, n), dtype=torch.float32)
    _lib().lld_gemm_packed(a.data_ptr(), a.stride(0), packed.data_ptr(), out.data_ptr(), n, m, n, k)
    return out


def raw_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b without autograd. a: [M, K] or [batch, M, K]; b: [K, N] or [batch, K, N] (any strides)."""
    _check(a, "a")
    _check(b, "b")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3) or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"fixed-order matmul: cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"fixed-order matmul: batch sizes differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.stride(-1) != 1:
        a = a.contiguous()
    batched = a.dim() == 3 or b.dim() == 3
    batch = a.shape[0] if a.dim() == 3 else (b.shape[0] if b.dim() == 3 else 1)
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    out = torch.empty((batch, m, n) if batched else (m, n), dtype=torch.float32)
    sab = a.stride(0) if a.dim() == 3 else 0
    sbb = b.stride(0) if b.dim() == 3 else 0
    rc = _lib().lld_bmm(a.data_ptr(), sab, a.stride(-2), b.data_ptr(), sbb, b.stride(-2), b.stride(-1),
                        out.data_ptr(), m * n, n, batch, m, n, k)
    if rc != 0:
        raise MemoryError("fixed-order matmul: out of memory packing the right-hand matrix")
    return out


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return raw_matmul(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = raw_matmul(grad, b.transpose(-1, -2))
            if a.dim() == 2 and ga.dim() == 3:
                ga = ga.sum(0)
        if ctx.needs_input_grad[1]:
            gb = raw_matmul(a.transpose(-1, -2).contiguous(), grad)
            if b.dim() == 2 and gb.dim() == 3:
                gb = gb.sum(0)
        return ga, gb


class _Linear(torch.autograd.Function):
    """x [M, in] @ weight[out, in]ᵀ with the weight's packings reused across calls."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _gemm_packed(x, _packed_weight(weight, transpose=True), weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = _gemm_packed(grad, _packed_weight(weight, transpose=False), weight.shape[1])
        if ctx.needs_input_grad[1]:
            gw = raw_matmul(grad.t().contiguous(), x)
        return gx, gw


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fixed order, with autograd when either input needs a gradient."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _Matmul.apply(a, b)
    return raw_matmul(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear` in fixed order: x [..., in] @ weight[out, in]ᵀ (+ bias)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _Linear.apply(x2, weight)
    else:
        y = _gemm_packed(x2, _packed_weight(weight, transpose=True), weight.shape[0])
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


if __name__ == "__main__":  # `python -m lld_monitor.backend.matmul`: build the kernel now (scripts/setup.sh)
    logging.basicConfig(level=logging.INFO)
    print(build(), isa())
