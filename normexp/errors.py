"""Errors that are the user's to fix: reported as one line, exit code 2, no traceback."""


class UserError(Exception):
    """Bad input (config, paths, checkpoints): the message says what is wrong and what to do."""


def one_line(error: BaseException) -> str:
    """The message of ``error`` as one line -- also when a loader worker raised it and PyTorch re-raised it
    with the worker's traceback in the message."""
    text = str(error).strip()
    if "Traceback" in text:
        text = text.splitlines()[-1].split(f"{type(error).__name__}: ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__
