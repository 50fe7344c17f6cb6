"""AdamW for the built-in trainer: torch.optim.AdamW's update, without torch.optim.

`torch.optim`'s optimizers import `torch._dynamo` on their first call (≈ 2 s, the largest part of the
trainer's start-up). This is the same update as torch's single-tensor AdamW (decoupled weight decay, bias
corrections, eps outside the square root), op for op, on plain parameter groups; the learning rate of a
group is set by the trainer each step (`lr_at`), so there is no scheduler object.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def lr_at(step: int, warmup_steps: int, schedule: str = "constant", total_steps: int = 0,
          min_lr_ratio: float = 0.0) -> float:
    """The lr multiplier of GRPO step `step` (0-based), as verl's `warmup_style`: a linear warm-up over
    `warmup_steps`, then 1 (`constant`) or a cosine from 1 down to `min_lr_ratio` at `total_steps` (`cosine`)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class AdamW:
    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups = []
        for g in groups:
            group = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, **g}
            group["params"] = list(group["params"])
            group.setdefault("initial_lr", group["lr"])
            self.param_groups.append(group)
        self.state: dict[torch.Tensor, dict] = {}

    def set_lr_factor(self, factor: float) -> None:
        """Every group's lr = its initial lr x factor."""
        for g in self.param_groups:
            g["lr"] = g["initial_lr"] * factor

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for g in self.param_groups:
            lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state.get(p)
                if st is None:
                    st = self.state[p] = {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                st["step"] += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                st["exp_avg"].lerp_(p.grad, 1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** st["step"]
                bias_correction2_sqrt = (1 - beta2 ** st["step"]) ** 0.5
                denom = (st["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-lr / bias_correction1)

    def state_dict(self) -> dict:
        """The moments and step counts (by parameter position) and the groups' lrs, copied."""
        index = [p for g in self.param_groups for p in g["params"]]
        return {"state": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.state[p].items()}
                          for i, p in enumerate(index) if p in self.state},
                "lrs": [(g["lr"], g["initial_lr"]) for g in self.param_groups]}

    def load_state_dict(self, sd: dict) -> None:
        index = [p for g in self.param_groups for p in g["params"]]
        self.state = {index[i]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                      for i, st in sd["state"].items()}
        for g, (lr, initial) in zip(self.param_groups, sd["lrs"]):
            g["lr"], g["initial_lr"] = lr, initial
