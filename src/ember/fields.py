"""A table of settings (a TOML table, a JSON object) checked against a dataclass's fields:
the names it knows, and each value of its field's kind. The data pipeline's clean and dedup
tables and `ember plan`'s profile files share this one check."""

from __future__ import annotations

import math
from dataclasses import fields

_KINDS = {"bool": "true or false", "int": "a whole number", "float": "a finite number"}


def checked_table(cls, table, where: str, error: type[Exception], *, skip=(), nonnegative: bool = False,
                  positive=()) -> dict:
    """`table` with floats made floats, or `error` with one sentence naming `where`. An int
    is taken where a float goes; numbers must be finite (and >= 0 with `nonnegative`, above 0
    for the names in `positive`); a text field takes text, or nothing when its type allows None."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise error(f"{where} must be a table of settings, not {table!r}.")
    known = {f.name: str(f.type) for f in fields(cls) if f.name not in skip}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise error(f"{where} has no setting {', '.join(unknown)}; it knows {', '.join(sorted(known))}.")
    out = dict(table)
    for name, value in table.items():
        kind = known[name]
        number = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and (value >= 0 or not nonnegative) and (value > 0 or name not in positive))
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "int":
            ok = number and isinstance(value, int)
        elif kind == "float":
            ok = number
        elif kind.startswith("str"):
            ok = isinstance(value, str) or (value is None and "None" in kind)
        else:
            ok = True
        if not ok:
            what = _KINDS.get(kind, "text")
            if kind in ("int", "float") and name in positive:
                what += " above 0"
            elif kind in ("int", "float") and nonnegative:
                what += " >= 0"
            raise error(f"{where} {name} = {value!r} must be {what}.")
        if kind == "float":
            out[name] = float(value)
    return out
