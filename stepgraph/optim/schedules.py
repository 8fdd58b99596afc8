"""Learning-rate schedules, evaluated inside the step from the device step counter.

A schedule is six float32 numbers in device memory (the state `optimizer.lr_schedule`), so
changing the LR or the schedule from Python writes memory and never re-captures a graph:

    [base_lr, warmup_steps, total_steps, min_lr, step_size, gamma]

At step t (1-based, counted before the update, as PyTorch's schedulers stepped per iteration):
- warmup, t <= warmup_steps:       base_lr * t / warmup_steps
- cosine, total_steps > 0:         min_lr + (base_lr - min_lr) * (1 + cos(pi * e / T)) / 2,
                                   e = clamp(t - 1 - warmup_steps, 0, T), T = total - warmup
- step decay, step_size > 0:       base_lr * gamma ** ((t - 1) // step_size)
- otherwise constant:              base_lr

Inside the step the schedule gives a factor, schedule_lr / base_lr (`schedule_factor`), and
each parameter's lr is that factor times its group's lr (optim/optimizer.py): exactly the
group's lr under the constant schedule, and every group moved alike under the others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCHEDULE_SLOTS = 6


@dataclass(frozen=True)
class Constant:
    def vector(self, base_lr: float) -> np.ndarray:
        return np.array([base_lr, 0, 0, 0, 0, 1], dtype=np.float32)


@dataclass(frozen=True)
class StepDecay:
    """torch.optim.lr_scheduler.StepLR(step_size, gamma), stepped every optimizer step."""
    step_size: int
    gamma: float = 0.1

    def vector(self, base_lr: float) -> np.ndarray:
        return np.array([base_lr, 0, 0, 0, self.step_size, self.gamma], dtype=np.float32)


@dataclass(frozen=True)
class Cosine:
    """torch.optim.lr_scheduler.CosineAnnealingLR(T_max=total_steps, eta_min=min_lr) for
    steps up to total_steps; after that the LR stays at min_lr (torch's would rise again)."""
    total_steps: int
    min_lr: float = 0.0

    def vector(self, base_lr: float) -> np.ndarray:
        return np.array([base_lr, 0, self.total_steps, self.min_lr, 0, 1], dtype=np.float32)


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup from 0 over warmup_steps, then cosine down to min_lr at total_steps."""
    warmup_steps: int
    total_steps: int
    min_lr: float = 0.0

    def __post_init__(self):
        if not 0 < self.warmup_steps < self.total_steps:
            raise ValueError("need 0 < warmup_steps < total_steps, got "
                             f"{self.warmup_steps}, {self.total_steps}")

    def vector(self, base_lr: float) -> np.ndarray:
        return np.array([base_lr, self.warmup_steps, self.total_steps, self.min_lr, 0, 1],
                        dtype=np.float32)


def schedule_lr(vector: np.ndarray, step: int) -> float:
    """The formulas above, in float64 (the CUDA kernel computes the same in double)."""
    base, warmup, total, min_lr, step_size, gamma = (float(v) for v in vector)
    if warmup > 0 and step <= warmup:
        return base * step / warmup
    if total > 0:
        span = total - warmup
        e = min(max(step - 1 - warmup, 0.0), span)
        return min_lr + (base - min_lr) * (1 + math.cos(math.pi * e / span)) / 2
    if step_size > 0:
        return base * gamma ** ((step - 1) // int(step_size))
    return base


def schedule_factor(vector: np.ndarray, step: int) -> float:
    """schedule_lr(vector, step) / base_lr in float64 (1.0 exactly for the constant schedule):
    the factor of every group's lr at `step` (the update ops' lr input). With base_lr 0 the
    schedule's shape for a base of 1 and min_lr 0 (the groups' lrs then set the scale)."""
    base = float(vector[0])
    if base == 0.0:
        unit = np.array(vector, dtype=np.float64)
        unit[0], unit[3] = 1.0, 0.0
        return schedule_lr(unit, step)
    return schedule_lr(vector, step) / base
