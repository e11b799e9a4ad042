"""The error every user mistake in configuration raises: the command line turns it into one
sentence and exit status 2, before any compute is spent."""


class ConfigError(ValueError):
    """A user's mistake in a recipe, an override or a command-line value."""
