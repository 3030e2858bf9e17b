"""Errors that describe a problem with the user's input, not a bug.

The CLI prints a ``UserError`` as one line (no traceback) and exits with code 2.
It subclasses ``ValueError`` so library callers can catch it the usual way.
"""


class UserError(ValueError):
    """Bad data, config, checkpoint or arguments; the message names the fix."""
