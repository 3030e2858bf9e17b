"""Pick the model class from ``config.type``."""

from __future__ import annotations

import os
from typing import Union

from .lm import MODEL_TYPES, CausalLM, LanguageModel, LMConfig


def model_class(model_type: str) -> type:
    """The CausalLM subclass for a ``model.type``."""
    from .baselines import RNNLanguageModel, SRULanguageModel, TransformerLanguageModel

    classes = {"srupp": LanguageModel, "sru": SRULanguageModel, "lstm": RNNLanguageModel,
               "gru": RNNLanguageModel, "transformer": TransformerLanguageModel}
    assert set(classes) == set(MODEL_TYPES)
    return classes[model_type]


def build_model(config: Union[LMConfig, dict], device=None, dtype=None) -> CausalLM:
    """A freshly initialised model of ``config.type`` (srupp, sru, lstm, gru, transformer)."""
    if isinstance(config, dict):
        config = LMConfig.from_dict(config)
    return model_class(config.type)(config, device=device, dtype=dtype)


def load_model(directory: Union[str, os.PathLike], *, device=None) -> CausalLM:
    """A model saved by ``save_pretrained``, of whatever type it was saved as, in eval mode."""
    return CausalLM.from_pretrained(directory, device=device)
