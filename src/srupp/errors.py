"""Errors that describe a problem with the user's input, not a bug.

The library's own modules (``srupp.nn``, ``ops``, ``models``, ``data``,
``inference``) raise plain ``ValueError`` and ``TypeError`` in the terms of the
Python API; ``UserError`` is for messages in the terms of the config, the
files and the command line. It subclasses ``ValueError`` so library callers
can catch it the usual way.

The CLI prints a ``UserError`` as one line (no traceback) and exits with code
2; any other ``ValueError`` or ``TypeError`` is a bug and keeps its traceback.
Where the CLI or the trainer hands the user's input (a recipe, ``--set``
values, a corpus, lines on stdin) to the library, :func:`user_input` turns
the library's ``ValueError``/``TypeError`` about it into a ``UserError``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class UserError(ValueError):
    """Bad data, config, checkpoint or arguments; the message names the fix."""


@contextlib.contextmanager
def user_input() -> Iterator[None]:
    """Inside this block a ``ValueError`` or ``TypeError`` is the input's fault: it is
    re-raised as a :class:`UserError` with the same message (the original chained).

    Wrap only the calls that read what the user gave, so that a bug elsewhere
    keeps its traceback. A missing optional package (an ``ImportError`` that is
    also a ``ValueError``) passes unchanged.
    """
    try:
        yield
    except (UserError, ImportError):
        raise
    except (ValueError, TypeError) as e:
        raise UserError(str(e)) from e
