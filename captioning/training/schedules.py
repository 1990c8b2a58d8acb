"""Learning-rate schedules (multipliers of the optimizer's base lr, for ``LambdaLR``)."""

from __future__ import annotations

from collections.abc import Callable


def noam(d_model: int, warmup: int, factor: float = 1.0) -> Callable[[int], float]:
    """``factor * d^-0.5 * min(s^-0.5, s * w^-1.5)`` with s counted from 1 (use with base lr 1.0)."""

    def f(step: int) -> float:
        s = step + 1
        return factor * d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)

    return f


def step_decay(every: int, gamma: float) -> Callable[[int], float]:
    return lambda step: gamma ** (step // every)


def constant() -> Callable[[int], float]:
    return lambda step: 1.0
