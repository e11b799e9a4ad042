"""The one exception the data package raises for a user's mistake."""


class DataError(ValueError):
    """Bad input data, arguments or prepared folder; the message says what to change."""
