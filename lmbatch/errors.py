"""Errors a user can cause: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (unknown task, missing model, too-long prompt, ...)."""
