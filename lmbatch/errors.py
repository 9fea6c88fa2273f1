"""Errors a user can cause: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (unknown task, missing model, too-long prompt, ...)."""


class Interrupted(Exception):
    """A run stopped by SIGINT/SIGTERM; the message says what was kept. The CLI exits 130."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name if it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
