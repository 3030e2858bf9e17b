"""The version of every file format srupp writes, and the one check that reads it.

Saved model configs (``config.json``), run directories (their ``config.json``
and the ``last.json``/``best.json`` pointers) and checkpoints (``trainer.pt``)
carry ``format_version``. A reader calls :func:`check_format_version`
on the JSON object it loaded: a version this code does not read (newer, older,
or missing) is one clear :class:`~srupp.errors.UserError`, never a half-read run.

Raise :data:`FORMAT_VERSION` when a change makes old files unreadable, and say
so in the CHANGELOG.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from .errors import UserError

FORMAT_VERSION = 1
KEY = "format_version"


def with_format_version(d: Mapping[str, Any]) -> Dict[str, Any]:
    """``d`` with this code's ``format_version`` first (what every writer saves)."""
    return {KEY: FORMAT_VERSION, **{k: v for k, v in d.items() if k != KEY}}


def without_format_version(d: Mapping[str, Any]) -> Dict[str, Any]:
    """``d`` less its ``format_version`` (what a reader hands on, once checked)."""
    return {k: v for k, v in d.items() if k != KEY}


def check_format_version(d: Mapping[str, Any], where: object) -> None:
    """UserError unless ``d["format_version"]`` is the version this code reads.

    ``where`` names the file or folder in the message.
    """
    version = d.get(KEY)
    if version == FORMAT_VERSION and not isinstance(version, bool):
        return
    if version is None:
        raise UserError(f"{where} has no {KEY}: it was written by a development version of "
                        f"srupp this one does not read; train or save it again")
    raise UserError(f"{where} has {KEY} {version!r}, but this srupp reads version "
                    f"{FORMAT_VERSION}; use the srupp that wrote it, or train or save it again")
