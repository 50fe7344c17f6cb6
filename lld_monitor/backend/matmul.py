"""Matrix products in a fixed summation order (`matmul.c`), for the built-in model's pinned numerics.

Every output element is one chain of fused multiply-adds over k = 0 .. K-1, so its bits depend on its own
row and column only: the same on every x86-64 CPU with AVX2 and FMA, and the same whatever batch a row is
in. MKL's GEMM gives neither (its code path follows the CPU and the matrix sizes), and its one
CPU-independent branch (`MKL_CBWR=COMPATIBLE`, SSE2) runs at about a quarter of its AVX-512 speed. Where
the CPU has AVX-512 the kernel computes twice the columns at once, by the same chains, so with the same
bits (`LLD_MATMUL_ISA=avx2` keeps the AVX2 kernel; the tests compare the two).

The C source is compiled once per machine with the system C compiler into the user cache (`ckernels.py`;
`scripts/setup.sh` does it ahead of time) and called through ctypes. `matmul` and `linear` carry autograd; their backward
products go through the same kernel. A weight is packed once per value (a parameter's `_version` moves
with every in-place update), which is what makes the rollout's many one-token products cheap.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .ckernels import ISA_ENV, KernelUnavailable, available, lib

__all__ = ["ISA_ENV", "KernelUnavailable", "available", "isa", "linear", "matmul", "pack", "raw_matmul"]


def isa() -> str:
    """The kernel this process runs: 'avx512' or 'avx2' (the same bits either way)."""
    return lib().isa


def _check(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"fixed-order matmul: {name} must be a float32 CPU tensor, got {x.dtype} on {x.device}")


def pack(b: torch.Tensor) -> torch.Tensor:
    """B [K, N] (any strides) packed for `lld_gemm_packed`: 16-column panels, k-major, zero-padded."""
    _check(b, "b")
    k, n = b.shape
    out = torch.empty(lib().lld_packed_size(k, n), dtype=torch.float32)
    lib().lld_pack_b(b.data_ptr(), b.stride(0), b.stride(1), k, n, out.data_ptr())
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
    lib().lld_gemm_packed(a.data_ptr(), a.stride(0), packed.data_ptr(), out.data_ptr(), n, m, n, k)
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
    rc = lib().lld_bmm(a.data_ptr(), sab, a.stride(-2), b.data_ptr(), sbb, b.stride(-2), b.stride(-1),
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
