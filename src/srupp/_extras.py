"""Optional dependencies: import one, or say which ``pip install`` line adds it.

The core package needs only torch, numpy, safetensors and tqdm. Everything
else belongs to an extra of ``pyproject.toml`` (plots, subword, translation,
triton, onnx, hf, tensorboard; ``all`` is every one of them), imported where it is used::

    plt = require("matplotlib.pyplot", "plots", "srupp compare's curves.png")
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional


# The optional modules srupp imports, and the extra that installs each; the
# same groups as pyproject.toml's [project.optional-dependencies] (tested).
EXTRA_OF = {
    "matplotlib": "plots",
    "sentencepiece": "subword",
    "sacrebleu": "translation",
    "triton": "triton",
    "onnx": "onnx",
    "onnxscript": "onnx",
    "onnxruntime": "onnx",
    "transformers": "hf",
    "tensorboard": "tensorboard",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
}


class MissingExtra(ImportError, ValueError):
    """An optional dependency is not installed; the message names the fix.

    An ``ImportError`` (what it is) and a ``ValueError``, so the CLI prints it
    as one line and exits with code 2, like any other fixable input.
    """


def install_hint(module: str, extra: Optional[str] = None) -> str:
    """``pip install 'srupp[plots]'`` for ``matplotlib.pyplot``, say."""
    top = module.split(".")[0]
    extra = extra or EXTRA_OF.get(top)
    return f"pip install 'srupp[{extra}]'" if extra else f"pip install {top}"


def require(module: str, extra: Optional[str] = None, what: Optional[str] = None) -> ModuleType:
    """Import ``module`` (dotted names allowed), or raise :class:`MissingExtra`.

    ``extra`` is the ``srupp[extra]`` group that installs it (default: from
    :data:`EXTRA_OF`); ``what`` names the feature that needs it (default: srupp).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name != top and not e.name.startswith(top + "."):
            raise  # the package is there; something it imports is broken
        raise MissingExtra(f"{what or 'srupp'} needs {top}: {install_hint(module, extra)}",
                           name=top) from None
