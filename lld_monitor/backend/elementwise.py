"""exp, log, sin, cos and sqrt of pinned numerics (`elementwise.c`), and the switch that makes torch use them.

ATen computes `torch.exp`, `log`, `sqrt`, `sin`, `cos` (and `tan`, `tanh`, `erf`, `erfc`, `erfinv`, `acos`,
`asin`, `atan`, `log2`, `log10`) of float tensors with MKL's VML. VML chooses its code by CPU vendor and
instruction set and, on a non-Intel CPU, ignores `MKL_CBWR`: an AMD EPYC runs VML's "EX" code, whose sqrt goes
through the approximate `rsqrtps` instruction, and an Intel CPU under `MKL_CBWR=COMPATIBLE` runs another. The
trainer's updates call sqrt (AdamW, the GRPO group std) and exp (the PPO ratio, the k3 KL, the entropy), so
their bits depended on the CPU (docs/backend.md, "Reproducibility").

`install()` registers this module's kernels as ATen's CPU kernels of those operators for the rest of the
process (`torch.library`), so every caller (lld.py, AdamW, the model, autograd's own formulas) gets them
without a code path of its own; `uninstall()` restores ATen's. The operators of the list above that have no
kernel here raise `UnpinnedOperatorError` while installed: a pinned run must not reach VML by a new code path
unnoticed. Integer inputs are promoted to the default float dtype, as ATen does; bfloat16 and float16 are
computed in float32 and rounded back; complex inputs are refused.
"""

from __future__ import annotations

import logging
import warnings

import torch

from .ckernels import ELEMENTWISE, lib

log = logging.getLogger(__name__)

# ATen operators whose CPU float kernels call MKL VML (aten/src/ATen/cpu/vml.h, torch 2.13) and that have no
# kernel here: refused while installed.
REFUSED = ("tan", "tanh", "erf", "erfc", "erfinv", "acos", "asin", "atan", "log2", "log10")

_library: torch.library.Library | None = None


class UnpinnedOperatorError(RuntimeError):
    """A pinned run reached an operator whose ATen kernel depends on the CPU, or an input it cannot compute."""


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if x.is_complex():
        raise UnpinnedOperatorError(f"pinned numerics compute real float tensors only; got a {x.dtype} input")
    if x.dtype in (torch.float32, torch.float64):
        return x.dtype
    return torch.float32 if x.is_floating_point() else torch.get_default_dtype()


def apply(name: str, x: torch.Tensor) -> torch.Tensor:
    """`name`(x) by `elementwise.c` (name in exp, log, sin, cos, sqrt): a new contiguous CPU tensor."""
    dtype = _compute_dtype(x)
    src = x.to(dtype).contiguous()
    out = torch.empty(src.shape, dtype=dtype)
    fn = getattr(lib(), f"lld_{name}_{'f32' if dtype == torch.float32 else 'f64'}")
    fn(src.data_ptr(), out.data_ptr(), src.numel())
    return out if x.dtype == dtype or not x.is_floating_point() else out.to(x.dtype)


def _kernels(name: str):
    def functional(self):
        return apply(name, self)

    def out_variant(self, *, out):
        result = apply(name, self if self.dtype == out.dtype or not out.is_floating_point() else self.to(out.dtype))
        out.resize_(result.shape)
        return out.copy_(result)

    def in_place(self):
        return self.copy_(apply(name, self))

    return functional, out_variant, in_place


def _refusal(name: str):
    def refuse(*args, **kwargs):
        raise UnpinnedOperatorError(
            f"torch.{name} is not part of pinned numerics: ATen computes it with MKL's VML, whose results depend on "
            f"the CPU (docs/backend.md, 'Reproducibility'). Give it a kernel in lld_monitor/backend/elementwise.c, "
            f"or train with numerics 'native'")

    return refuse, refuse, refuse


def install() -> None:
    """Route ATen's CPU exp/log/sin/cos/sqrt to `elementwise.c` (and refuse the other VML operators), for
    this process, until `uninstall()`. Idempotent."""
    global _library
    if _library is not None:
        return
    lib()  # build/load first: a missing compiler is a clear error here, not inside an operator
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name in (*ELEMENTWISE, *REFUSED):
            functional, out_variant, in_place = _kernels(name) if name in ELEMENTWISE else _refusal(name)
            library.impl(name, functional, "CPU")
            library.impl(f"{name}.out", out_variant, "CPU")
            library.impl(f"{name}_", in_place, "CPU")
    _library = library
    log.debug("pinned numerics: ATen's CPU %s now run elementwise.c", ", ".join(ELEMENTWISE))


def uninstall() -> None:
    """Give ATen its own kernels back."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def installed() -> bool:
    return _library is not None
