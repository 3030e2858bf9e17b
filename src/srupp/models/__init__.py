"""Language models built on the SRU++ layers, and baselines that share their trainer.

One registry (:mod:`srupp.models.base`: task -> type -> (config class, model
class)) covers them all; ``MODELS`` is its language models. Each model type has
its own config dataclass (:mod:`srupp.models.config` for language models).
"""

from . import baselines  # noqa: F401  (its models enter the registry)
from .config import (GRUConfig, LMConfig, LSTMConfig, SRUConfig, SRUppConfig,
                     TransformerConfig)
from .classifier import (Classifier, ClassifierBase, ClassifierConfig, ClassifierOutput,
                         LSTMClassifier, LSTMClassifierConfig, SRUClassifier,
                         SRUClassifierConfig, SRUppClassifierConfig, TransformerClassifier,
                         TransformerClassifierConfig)
from .base import (REGISTRY, TASKS, SavedModel, build_model, config_from_dict, load_config,
                   load_model, model_class, parameter_counts, task_models)
from .lm import MODELS, CausalLM, LanguageModel, LMOutput, sample
from .state import TensorState, load_state, load_state_metadata, save_state, state_from_dict
from .seq2seq_baselines import (LSTMSeq2Seq, LSTMSeq2SeqConfig, SRUSeq2Seq, SRUSeq2SeqConfig,
                                TransformerSeq2Seq, TransformerSeq2SeqConfig)

MODEL_TYPES = tuple(MODELS)

__all__ = ["Classifier", "ClassifierBase", "ClassifierConfig", "ClassifierOutput",
           "LSTMClassifier", "LSTMClassifierConfig", "SRUClassifier", "SRUClassifierConfig",
           "SRUppClassifierConfig", "TransformerClassifier", "TransformerClassifierConfig",
           "REGISTRY", "SavedModel", "TASKS", "task_models", "CausalLM", "GRUConfig", "LanguageModel", "LMConfig", "LMOutput", "LSTMConfig",
           "MODELS", "MODEL_TYPES", "SRUConfig", "SRUppConfig", "TensorState",
           "TransformerConfig", "build_model", "config_from_dict", "load_config", "load_model",
           "model_class", "parameter_counts", "sample", "state_from_dict"]
__all__ += ["load_state", "load_state_metadata", "save_state"]
__all__ += ["LSTMSeq2Seq", "LSTMSeq2SeqConfig", "SRUSeq2Seq", "SRUSeq2SeqConfig",
            "TransformerSeq2Seq", "TransformerSeq2SeqConfig"]
from .seq2seq import (EncoderOutput, Seq2Seq, Seq2SeqConfig, Seq2SeqModel, Seq2SeqOutput,
                      SRUppSeq2SeqConfig)
from .decoding import Hypothesis, beam_search, greedy_decode, max_target_length
__all__ += ["EncoderOutput", "Seq2Seq", "Seq2SeqConfig", "Seq2SeqModel", "Seq2SeqOutput",
            "SRUppSeq2SeqConfig", "Hypothesis", "beam_search", "greedy_decode",
            "max_target_length"]
