"""How long a run lasts and how often it evaluates and checkpoints: budgets written as a
time ("90s", "10m", "2h"), a token count ("1e8tok") or a step count ("500steps")."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ember.errors import ConfigError


@dataclass(frozen=True)
class Budget:
    """How long a run lasts: `kind` is "seconds", "tokens" or "steps"."""

    kind: str
    amount: float

    def __str__(self) -> str:
        if self.kind == "seconds":
            return f"{self.amount:g}s"
        return f"{self.amount:g}{'tok' if self.kind == 'tokens' else 'steps'}"


_UNITS = {
    "s": ("seconds", 1), "sec": ("seconds", 1), "m": ("seconds", 60), "min": ("seconds", 60),
    "h": ("seconds", 3600), "d": ("seconds", 86400),
    "tok": ("tokens", 1), "tokens": ("tokens", 1), "steps": ("steps", 1), "step": ("steps", 1),
}
_BUDGET = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)\s*$", re.IGNORECASE)


def parse_budget(text: str, name: str = "budget") -> Budget:
    """'90s', '10m', '2h', '1e8tok', '500steps' -> Budget."""
    match = _BUDGET.match(str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    if unit and not 0 < float(match.group(1)) < math.inf:
        raise ConfigError(f"{name} {text!r} must be a positive, finite amount, such as 90s or 500steps.")
    if not unit:
        raise ConfigError(
            f"{name} {text!r} is not understood; write a time (90s, 10m, 2h), "
            "tokens (1e8tok) or steps (500steps)."
        )
    kind, scale = unit
    amount = float(match.group(1)) * scale
    if kind == "steps" and not amount.is_integer():
        raise ConfigError(f"{name} {text!r} is not a whole number of steps.")
    return Budget(kind, amount)


def parse_interval(text: str, name: str) -> Budget:
    """Intervals (eval, checkpoint) are steps or times; tokens make no sense there."""
    try:
        interval = parse_budget(text, name)
    except ConfigError as err:
        if "not understood" not in str(err):
            raise
        raise ConfigError(f"{name} {text!r} is not understood; write a number of steps (100steps) or a time "
                          "(90s, 5m).") from None
    if interval.kind == "tokens":
        raise ConfigError(f"{name} must be a number of steps (100steps) or a time (5m), not {text!r}.")
    return interval
