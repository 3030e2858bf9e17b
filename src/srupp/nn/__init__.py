"""SRU and SRU++ layers and the state they carry.

    sru.py         the recurrence every layer shares, and plain SRU (SRU, SRUCell)
    srupp.py       SRU++: the attention sub-layer, SRUppLayer, SRUpp and its step()
    stack_step.py  a stack's decoding steps in one C++ call (StepPlan, plan_steps)
    state.py       SRUppState, the state carried between calls, and its K/V cache
    append.py      append_steps: growing a cache without copying it
    linear.py      nn.Linear whose bias-free products go through srupp.ops.linear
    adaptive.py    adaptive input embeddings and softmax for large vocabularies
    reference.py   a minimal SRU++ layer written like the paper's equations (the check)
"""

from .adaptive import AdaptiveInput, ProjectedAdaptiveLogSoftmax
from .reference import srupp_layer_reference
from .sru import SRU, SRUCell
from .srupp import SRUpp, SRUppAttention, SRUppLayer, SRUppProjectedLinear
from .state import SRUppState

# the reference package sru names its SRU++ layer SRUppCell: code written against it keeps working
SRUppCell = SRUppLayer

__all__ = ["SRU", "SRUCell", "SRUpp", "SRUppLayer", "SRUppCell", "SRUppState", "SRUppAttention",
           "SRUppProjectedLinear", "AdaptiveInput", "ProjectedAdaptiveLogSoftmax",
           "srupp_layer_reference"]
