"""The data pipeline's error for a user's mistake, and the check of a TOML table's kinds."""

from __future__ import annotations

from dataclasses import fields


class DataError(ValueError):
    """Bad input data, arguments or prepared folder; the message says what to change."""


_KINDS = {"bool": "true or false", "int": "a whole number", "float": "a number"}


def typed_table(cls, table, section: str) -> dict:
    """`table` (a TOML table for dataclass `cls`) checked: known names, and each bool, int,
    float or text field given a value of its kind (an int where a float goes is taken)."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise DataError(f"[{section}] must be a table of settings, not {table!r}.")
    known = {f.name: str(f.type) for f in fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise DataError(f"[{section}] has no setting {', '.join(unknown)}; it knows {', '.join(sorted(known))}.")
    out = dict(table)
    for name, value in table.items():
        kind = known[name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = {"bool": isinstance(value, bool), "int": number and isinstance(value, int),
              "float": number}.get(kind, isinstance(value, str) or (value is None and "None" in kind)
                                   if kind.startswith("str") else True)
        if not ok:
            what = _KINDS.get(kind, "text")
            raise DataError(f"[{section}] {name} = {value!r} must be {what}.")
        if kind == "float":
            out[name] = float(value)
    return out
