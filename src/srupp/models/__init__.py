"""Language models built on the SRU++ layers, and baselines that share their trainer.

One registry (``MODELS``: type -> (config class, model class)) covers them all;
each model type has its own config dataclass (:mod:`srupp.models.config`).
"""

from . import baselines  # noqa: F401  (its models enter the registry)
from .config import (GRUConfig, LMConfig, LSTMConfig, SRUConfig, SRUppConfig,
                     TransformerConfig)
from .lm import (MODELS, CausalLM, LanguageModel, LMOutput, build_model, config_from_dict,
                 load_config, load_model, model_class, parameter_counts, sample)
from .state import TensorState, state_from_dict

MODEL_TYPES = tuple(MODELS)

__all__ = ["CausalLM", "GRUConfig", "LanguageModel", "LMConfig", "LMOutput", "LSTMConfig",
           "MODELS", "MODEL_TYPES", "SRUConfig", "SRUppConfig", "TensorState",
           "TransformerConfig", "build_model", "config_from_dict", "load_config", "load_model",
           "model_class", "parameter_counts", "sample", "state_from_dict"]
