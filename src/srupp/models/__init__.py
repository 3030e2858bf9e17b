"""srupp's models: backbones (SRU++, SRU, LSTM, GRU, transformer) under three task heads.

    CausalLM            language modelling and generation (task "lm")
    EncoderDecoder      translation, with greedy and beam search (task "translate")
    SequenceClassifier  one label per sequence (task "classify")

A config's ``task`` picks the head and its ``type`` the backbone
(:mod:`srupp.models.backbones`); :func:`build_model` builds any config,
:func:`load_model` loads any saved model.
"""

from .backbones import BACKBONES, Backbone, EncoderOutput, register_backbone
from .base import SavedModel
from .classifier import ClassifierOutput, SequenceClassifier
from .config import (TASK_NAMES, ClassifierConfig, LMConfig, Seq2SeqConfig,
                     SRUppClassifierConfig, SRUppConfig, SRUppSeq2SeqConfig, config_class,
                     config_from_dict)
from .decoding import Hypothesis, beam_search, greedy_decode
from .lm import CausalLM, LMOutput, sample
from .registry import build_model, load_model, parameter_counts
from .seq2seq import EncoderDecoder, Seq2SeqOutput
from .state import TensorState, load_state, load_state_metadata, save_state

__all__ = [
    "CausalLM", "EncoderDecoder", "SequenceClassifier", "SavedModel",
    "LMOutput", "Seq2SeqOutput", "ClassifierOutput", "EncoderOutput",
    "LMConfig", "Seq2SeqConfig", "ClassifierConfig",
    "SRUppConfig", "SRUppSeq2SeqConfig", "SRUppClassifierConfig",
    "TASK_NAMES", "config_class", "config_from_dict",
    "build_model", "load_model", "parameter_counts",
    "BACKBONES", "Backbone", "register_backbone",
    "TensorState", "save_state", "load_state", "load_state_metadata",
    "sample", "Hypothesis", "beam_search", "greedy_decode",
]
