"""Models built on the SRU++ layers, and baselines that share their trainer."""

from .build import build_model, load_model, model_class
from .lm import MODEL_TYPES, CausalLM, LanguageModel, LMConfig, LMOutput, sample
from .state import TensorState, state_from_dict

__all__ = ["CausalLM", "LanguageModel", "LMConfig", "LMOutput", "MODEL_TYPES", "TensorState",
           "build_model", "load_model", "model_class", "sample", "state_from_dict"]
