"""srupp: fast SRU and SRU++ recurrent layers for PyTorch."""

__version__ = "0.1.0"

from . import nn, ops  # noqa: E402
from ._import_hooks import when_imported  # noqa: E402
from .allocator import tune_cpu_allocator  # noqa: E402


def _register_with_transformers() -> None:
    # Importing srupp.models.hf registers srupp's config, model and tokenizer with
    # transformers' Auto classes, so that AutoModelForCausalLM.from_pretrained and
    # pipeline() load exported srupp models without trust_remote_code.
    from .models import hf  # noqa: F401


# Only once transformers is imported (now, if it already is): `import srupp` itself
# neither needs transformers nor pays for importing it.
when_imported("transformers", _register_with_transformers)

__all__ = ["nn", "ops", "tune_cpu_allocator", "__version__"]
