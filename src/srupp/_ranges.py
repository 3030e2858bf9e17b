"""Numeric settings: finite, and in their range, checked in one place.

Every layer checks its numbers with these helpers: the model configs and the
library's entry points (ValueError, or TypeError for a value that is not a
number, in the terms of the Python API), the run config (UserError, in config
keys: ``train.lr``) and the command line's flags (argparse types, in flag
names: ``--temperature``). A range is written as the message says it::

    ">= 1"   "> 0"   "[0, 1)"   "(0, 1]"   "[0, 2**63)"   ""  (any finite number)

A number must be finite whatever its range: nan, inf and -inf never pass. An
integer setting takes integers only (never a bool). None passes: an optional
setting left unset.

A config dataclass lists its ranges in a class attribute ``_ranges`` (no
annotation, so not a field), ``{field: range}``; :func:`check_fields` merges
the ``_ranges`` of the class and its bases and checks every int and float
field: each one in the table against its range, every other float for being
finite, every other int for being an integer.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import typing
from functools import lru_cache
from typing import Any, Dict, Optional, Tuple

__all__ = ["check", "check_fields", "problem"]

_ONE_SIDED = re.compile(r"^(>=|>|<=|<)\s*(\S+)$")
_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])$")


def _bound(text: str):
    """A range's bound: an int, a float, or ``2**63``."""
    base, power = text.partition("**")[::2]
    if power:
        return int(base) ** int(power)
    try:
        return int(text)
    except ValueError:
        return float(text)


@lru_cache(maxsize=None)
def _parse(rng: str) -> Tuple[Any, Any, bool, bool]:
    """A range -> (low, high, low included, high included); infinite where open-ended."""
    rng = rng.strip()
    if not rng:
        return -math.inf, math.inf, False, False
    one = _ONE_SIDED.match(rng)
    if one:
        op, bound = one[1], _bound(one[2])
        if op.startswith(">"):
            return bound, math.inf, op == ">=", False
        return -math.inf, bound, False, op == "<="
    two = _INTERVAL.match(rng)
    if two:
        return _bound(two[2]), _bound(two[3]), two[1] == "[", two[4] == "]"
    raise ValueError(f"not a range: {rng!r} (write '>= 1', '> 0', '[0, 1)', ...)")


def _is_number(value: Any, integer: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral if integer else numbers.Real)


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def problem(value: Any, rng: str = "", *, integer: bool = False) -> Optional[str]:
    """None when ``value`` is a finite number (an integer with ``integer``) in ``rng``,
    or None; else what it must be: ``"must be in [0, 1), got nan"``."""
    if value is None:
        return None
    low, high, low_in, high_in = _parse(rng)
    finite_bounds = math.isfinite(low) and math.isfinite(high)
    shape = rng.strip()
    if shape and finite_bounds:
        shape = f"in {shape}"  # an interval: finite already
    kind = "an integer" if integer else "a finite number" if not finite_bounds else "a number"
    if not _is_number(value, integer) or not math.isfinite(value):
        return f"must be {kind}{' ' + shape if shape else ''}, got {_shown(value)}"
    inside = ((low < value or (low_in and low == value))
              and (value < high or (high_in and high == value)))
    if not inside:
        return f"must be {shape}, got {_shown(value)}"
    return None


def check(name: str, value: Any, rng: str = "", *, integer: bool = False,
          error: Optional[type] = None):
    """``value``, unless it is not a finite number in ``rng`` (see :func:`problem`).

    Raises ValueError for a number out of range or not finite (nan, inf, -inf,
    for an integer setting too), TypeError for a value that is not a number (or
    a finite one that is not an integer, with ``integer``); ``error``, when
    given, for both (UserError for config keys and flags).
    """
    message = problem(value, rng, integer=integer)
    if message is not None:
        if error is None:
            number = _is_number(value, False)
            error = (ValueError if number and (_is_number(value, integer)
                                               or not math.isfinite(value)) else TypeError)
        raise error(f"{name} {message}")
    return value


@lru_cache(maxsize=None)
def _numeric_fields(cls: type) -> Dict[str, Tuple[str, bool]]:
    """{field: (range, integer)} for the int and float fields of dataclass ``cls``."""
    ranges: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        ranges.update(vars(klass).get("_ranges", {}))
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if typing.get_origin(typ) is typing.Union:  # Optional[X]
            args = [a for a in typing.get_args(typ) if a is not type(None)]
            typ = args[0] if len(args) == 1 else None
        if typ in (int, float):
            out[f.name] = (ranges.pop(f.name, ""), typ is int)
    if ranges:
        raise TypeError(f"{cls.__name__}._ranges names {', '.join(sorted(ranges))}, "
                        f"which are not int or float fields")
    for rng, _ in out.values():
        _parse(rng)  # a typo in a range is the class's bug: fail at its first use
    return out


def check_fields(config: Any, *, prefix: str = "", error: Optional[type] = None) -> None:
    """Check every int and float field of the dataclass ``config`` (see the module
    docstring); the message names the field as ``prefix + name``."""
    for name, (rng, integer) in _numeric_fields(type(config)).items():
        check(prefix + name, getattr(config, name), rng, integer=integer, error=error)
