"""Errors that describe a problem with the user's input, not a bug.

The CLI prints a ``UserError`` as one line (no traceback) and exits with code 2,
as it does any ``ValueError`` or ``TypeError``: the library's own modules
(``srupp.nn``, ``ops``, ``models``, ``data``) raise those plain types in the
terms of the Python API, while ``UserError`` is for messages in the terms of
the config and the command line. It subclasses ``ValueError`` so library
callers can catch it the usual way.
"""


class UserError(ValueError):
    """Bad data, config, checkpoint or arguments; the message names the fix."""
