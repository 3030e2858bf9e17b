"""srupp: fast SRU and SRU++ recurrent layers for PyTorch.

``import srupp`` stays light: it does not import transformers, onnx or the
models. The Hugging Face classes register with transformers' Auto classes when
``srupp.hf`` is imported (``import srupp.hf``).
"""

__version__ = "0.1.0"

from . import nn, ops  # noqa: E402
from .allocator import tune_cpu_allocator  # noqa: E402

__all__ = ["nn", "ops", "tune_cpu_allocator", "__version__"]
