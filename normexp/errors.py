"""Errors that are the user's to fix: reported as one line, exit code 2, no traceback."""


class UserError(Exception):
    """Bad input (config, paths, checkpoints): the message says what is wrong and what to do."""
