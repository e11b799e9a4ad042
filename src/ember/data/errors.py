"""The data pipeline's error for a user's mistake."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data, arguments or prepared folder; the message says what to change."""
