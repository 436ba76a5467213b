"""User-facing errors: the CLI prints their message as one line and exits with status 2."""


class OmnidraftError(Exception):
    """An error caused by the user's input or environment, with a message that says what to do."""
