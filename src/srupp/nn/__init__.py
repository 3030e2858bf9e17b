"""SRU and SRU++ layers and the state they carry."""

from .adaptive import AdaptiveInput, ProjectedAdaptiveLogSoftmax
from .attention import SRUppAttention, SRUppProjectedLinear
from .sru import SRU, SRUCell
from .srupp import SRUpp, SRUppCell
from .state import SRUppState

__all__ = ["SRU", "SRUCell", "SRUpp", "SRUppCell", "SRUppState", "SRUppAttention",
           "SRUppProjectedLinear", "AdaptiveInput", "ProjectedAdaptiveLogSoftmax"]
