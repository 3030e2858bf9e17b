"""Run code right after a module is first imported, without importing it ourselves.

srupp registers its Hugging Face classes with ``transformers``' Auto classes
(:mod:`srupp.models.hf`). Importing transformers just to register would make
``import srupp`` slow and would need transformers installed, so instead
``srupp/__init__.py`` calls::

    when_imported("transformers", register)

If transformers is already imported, ``register`` runs at once. Otherwise a
finder at the front of ``sys.meta_path`` waits for the import of that name:
it lets the usual finders locate the module, wraps the loader so that
``register`` runs once the module's code has finished executing, and then
steps aside. A callback that fails is reported as a warning: it must never
break the import it is attached to.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from typing import Callable, List


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once the top-level module ``name`` is imported (now, if it is)."""
    if sys.modules.get(name) is not None:  # None: an import that is blocked, not done
        _run(name, callback)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImportFinder) and finder.name == name:
            finder.callbacks.append(callback)
            return
    sys.meta_path.insert(0, _AfterImportFinder(name, callback))


def _run(name: str, callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception as e:  # never break the user's import of `name`
        warnings.warn(f"srupp could not set itself up for {name} ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=3)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders find for ``name``."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name = name
        self.callbacks: List[Callable[[], None]] = [callback]

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        # Ask the finders after us directly (importlib.util.find_spec would ask us again).
        # find_spec is also called by mere availability probes, so stay in place until
        # the module has really been executed.
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenCall(spec.loader, self)
        return spec

    def done(self) -> None:
        """The module has been executed: leave sys.meta_path, run the callbacks."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for callback in self.callbacks:
            _run(self.name, callback)


class _ThenCall(importlib.abc.Loader):
    """The original loader, then the finder's callbacks."""

    def __init__(self, loader, finder: _AfterImportFinder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # Put the original loader back first, so the module (importlib.resources,
        # inspect, pkgutil) only ever sees its own loader.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.done()

    def __getattr__(self, attr):  # get_source, is_package, ... of the original loader
        return getattr(self.loader, attr)
