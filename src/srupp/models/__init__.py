"""Models built on the SRU++ layers."""

from .lm import LanguageModel, LMConfig, LMOutput, sample

__all__ = ["LanguageModel", "LMConfig", "LMOutput", "sample"]
