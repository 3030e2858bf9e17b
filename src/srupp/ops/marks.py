"""Marks for torch.compile that cost nothing at import.

``torch.compiler.assume_constant_result`` imports torch._dynamo (about a second, in
every process that imports srupp) only to set one attribute on the function;
:func:`constant_when_compiled` sets it without the import.
tests/ops/test_marks.py checks that torch's decorator still sets exactly that mark.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

#: The attribute torch.compile reads (torch/_dynamo/decorators.py).
CONSTANT_MARK = "_dynamo_marked_constant"


def constant_when_compiled(fn: F) -> F:
    """``torch.compiler.assume_constant_result``: under torch.compile, ``fn`` runs once at
    trace time and its result is baked into the graph."""
    setattr(fn, CONSTANT_MARK, True)
    return fn
