"""The interface every backbone offers the task heads (:mod:`srupp.models.lm`, ...).

A backbone maps embedded tokens x (B, L, d) to hidden states h (B, L, d), in
one of three roles:

    causal   a language model's body: position t sees x[:, :t+1]; carries state
    encoder  reads a whole sequence (bidirectional or non-causal), no state out
    decoder  causal over the target, reading an encoded source from its state

Its config fields are a dataclass (``fields``), which the config of every task
it serves inherits (:func:`srupp.models.config.config_class`); a task whose
defaults or extra fields differ names its own dataclass in ``task_fields``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

ROLES = ("causal", "encoder", "decoder")
TASK_ROLES = {"lm": ("causal",), "translate": ("encoder", "decoder"), "classify": ("encoder",)}


@dataclass
class EncoderOutput:
    """states (B, S, d): the encoder's output; pad (B, S) bool, True at padding, or None."""

    states: Tensor
    pad: Optional[Tensor]

    def index_select(self, index: Tensor) -> "EncoderOutput":
        """Rows ``index`` (B',): a list, or a tensor on any device."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.states.device)
        return EncoderOutput(self.states.index_select(0, index),
                             None if self.pad is None else self.pad.index_select(0, index))


class Backbone(nn.Module):
    """One stack of layers in one role (see the module doc); subclasses fill in the methods.

    ``config`` is a task config that holds the backbone's fields, ``d_model``
    and ``dropout``; the depth is ``num_layers`` or, for a translation model,
    ``encoder_layers`` / ``decoder_layers``.
    """

    label: ClassVar[str]                   # the configs' class-name prefix: "SRUpp" -> SRUppConfig
    fields: ClassVar[type]                 # the config fields this backbone reads (a dataclass)
    task_fields: ClassVar[Dict[str, type]] = {}  # a task's own fields dataclass, where it differs
    roles: ClassVar[Tuple[str, ...]] = ROLES
    pads_right: ClassVar[bool] = False     # True: a translation batch may pad only at row ends

    def __init__(self, config, *, role: str, device=None, dtype=None):
        super().__init__()
        if role not in self.roles:
            raise ValueError(f"{type(self).__name__} has no {role!r} role (it has "
                             f"{', '.join(self.roles)})")
        self.config, self.role = config, role
        self.factory = {"device": device, "dtype": dtype}

    @property
    def num_layers(self) -> int:
        return getattr(self.config, f"{self.role}_layers", None) or self.config.num_layers

    def forward(self, x: Tensor, state: Any = None, mask_pad: Optional[Tensor] = None
                ) -> Tuple[Tensor, Any]:
        """x (B, L, d), state (None: the initial one), mask_pad (B, L) bool
        -> (h (B, L, d), new state)."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Initialise every weight; the task heads call it once built, after their own."""
        raise NotImplementedError

    @classmethod
    def compare_fields(cls, d_model: int, model: Dict[str, Any]) -> Dict[str, Any]:
        """``srupp compare``: the fields this backbone sets when sized to width ``d_model``
        from a recipe whose model fields are ``model`` (heads that divide the width...)."""
        return {}

    def step(self, x: Tensor, state: Any) -> Tuple[Tensor, Any]:
        """One position per row, for decoding: x (B, d) -> (h (B, d), new state)."""
        h, state = self(x.unsqueeze(1), state)
        return h.squeeze(1), state

    def decode_plan(self, state: Any, n: int, like: Tensor) -> Any:
        """n decoding steps from ``state`` planned for one C++ call of ``decode_loop``
        (:class:`srupp.nn.stack_step.StepPlan`), for inputs like ``like`` (B, d); None where
        :meth:`step` must run them (every backbone but SRU++'s causal stack)."""
        return None

    def initial_state(self, batch_size: int, mem_len: Optional[int] = None) -> Any:
        """The causal role's state before the first token."""
        raise NotImplementedError

    def generation_state(self, batch_size: int, mem_len: Optional[int] = None) -> Any:
        """The state generation starts from (a KV cache may keep every position)."""
        return self.initial_state(batch_size, mem_len)

    def padded_state(self, batch_size: int, window: int) -> Any:
        """A causal state that decodes as :meth:`generation_state` does and keeps exactly
        ``window`` positions, padding included, from the start: the states of streams at
        different points then join into one batch (the serving engine's slots). A state
        with no time dimension (SRU, LSTM) is already so: this default returns it."""
        return self.generation_state(batch_size, window)

    def init_decoder(self, enc: EncoderOutput, *, steps: bool = True) -> Any:
        """The decoder role's state before its first token, holding what it reads of the source
        (computed once per sentence); ``steps=False``: for one teacher-forced call."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device
