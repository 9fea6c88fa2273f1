"""Errors the CLI prints as one line: a user's (exit code 2), a worker's (1), a stop (130)."""


class UserError(Exception):
    """Bad input from the user (unknown task, missing model, too-long prompt, ...)."""


class WorkerFailed(Exception):
    """A data-parallel worker (or a rank of its split model) failed or exited: the CLI prints it as one
    line and exits with code 1; what finished is in the run directory, and the same command resumes."""


class Interrupted(Exception):
    """A run stopped by SIGINT/SIGTERM; the message says what was kept. The CLI exits 130."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name if it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
