"""The backbones: one module per family, each a :class:`Backbone` in one or more roles.

A new backbone is a :class:`Backbone` subclass with a ``fields`` dataclass, plus
one line in :data:`BACKBONES` (or :func:`register_backbone`); it then serves
every task whose roles it has (:data:`TASK_ROLES`).
"""

from typing import Dict, Type

from .base import ROLES, TASK_ROLES, Backbone, EncoderOutput
from .rnn import GRUBackbone, LSTMBackbone
from .sru import SRUBackbone
from .srupp import CrossAttentionState, SRUppBackbone
from .transformer import TransformerBackbone

# model type -> backbone class, in the order the CLI and errors list them
BACKBONES: Dict[str, Type[Backbone]] = {
    "srupp": SRUppBackbone,
    "sru": SRUBackbone,
    "lstm": LSTMBackbone,
    "gru": GRUBackbone,
    "transformer": TransformerBackbone,
}


def register_backbone(name: str, backbone: Type[Backbone]) -> None:
    """Make ``backbone`` the model type ``name`` of every task its roles serve."""
    if not (isinstance(backbone, type) and issubclass(backbone, Backbone)):
        raise TypeError(f"register_backbone takes a Backbone subclass, got {backbone!r}")
    BACKBONES[name] = backbone


__all__ = ["BACKBONES", "ROLES", "TASK_ROLES", "Backbone", "CrossAttentionState",
           "EncoderOutput", "GRUBackbone", "LSTMBackbone", "SRUBackbone", "SRUppBackbone",
           "TransformerBackbone", "register_backbone"]
