"""Convert modules of the reference package ``sru`` (3.0.0.dev6) to srupp.

:func:`from_sru` reads the configuration of an ``sru.SRU``, ``sru.SRUpp``,
``sru.SRUCell`` or ``sru.SRUppCell`` instance, builds the equivalent
:mod:`srupp.nn` module on the same device and dtype, and copies every weight,
so that both compute the same function (see ``tests/test_convert.py``).

This module never imports ``sru``: it recognises the reference's classes by
name and package, so converting needs ``sru`` only to have built the module.

Layout differences handled here:

* U. The reference interleaves the k planes of U per unit (column u·k + m);
  srupp keeps them planar (column m·D + u). The rows of the linear map that
  produces U are permuted accordingly.
* ``weight_c`` and ``bias`` are flat (2·D,) in the reference, (2, D) here;
  the order [v_f | v_r] and [b_f | b_r] is the same.
* ``scale_x`` is a buffer in the reference and a Python float here; its value
  is copied.

Not convertible (``ValueError``): ``use_tanh=True``, ``v1=True``, a custom
``transform_module``, a pre-norm ``SRUppAttention`` (``normalize_after=False``
inside the attention), an attention layout that neither
``attention_every_n_layers`` nor ``attention_last_n_layers`` can express, and
``SRUpp(nn_rnn_compatible_return=True)`` (srupp's SRUpp returns an
:class:`~srupp.nn.SRUppState`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from . import nn as snn

__all__ = ["from_sru"]

_KINDS = ("SRU", "SRUpp", "SRUCell", "SRUppCell")


def from_sru(module: nn.Module, *, batch_first: bool = False, causal: bool = False,
             mem_len: Optional[int] = None) -> nn.Module:
    """Build the srupp equivalent of a module of the reference package ``sru``.

    ``sru.SRU`` becomes :class:`srupp.nn.SRU`, ``sru.SRUpp`` :class:`srupp.nn.SRUpp`,
    ``sru.SRUCell`` :class:`srupp.nn.SRUCell` and ``sru.SRUppCell``
    :class:`srupp.nn.SRUppLayer`. The result has the same configuration, device,
    dtype, weights (permuted to srupp's layout), ``requires_grad`` flags and
    training/eval mode. The reference module is not modified.

    Args:
        module: an instance of one of the four reference classes.
        batch_first: give the new module ``batch_first`` (the reference has
            no such option; its layout is ``batch_first=False``).
        causal: SRU++ only; build the new module with ``causal=True``. The
            reference has no such flag (it takes an explicit ``attn_mask``).
        mem_len: SRU++ only; the memory length the new module keeps.

    Returns:
        the new module.

    Raises:
        ValueError: ``module`` is not one of the reference's classes, or uses
            a feature srupp does not have (``use_tanh``, ``v1``, a custom
            ``transform_module``, SRU++ ``nn_rnn_compatible_return``, an
            attention layout neither ``attention_every_n_layers`` nor
            ``attention_last_n_layers`` describes).

    Example::

        import sru, torch
        from srupp.convert import from_sru

        ref = sru.SRUpp(64, 128, 32, num_layers=4, attention_last_n_layers=2).eval()
        ours = from_sru(ref)
        x = torch.randn(20, 3, 64)                   # (L, B, n_in)
        with torch.no_grad():
            h_ref, c_ref, _ = ref(x)
            h, state = ours(x)                       # state.c == c_ref
        torch.testing.assert_close(h, h_ref)

    Memory: the reference takes ``memory=[(M, B, n_in) per layer]`` and
    ``memory_mask_pad`` (M, B); srupp takes them batch-first in the state::

        state = srupp.nn.SRUppState(
            c=c0, memory=[None if m is None else m.transpose(0, 1) for m in memory],
            memory_mask_pad=memory_mask_pad.transpose(0, 1))
        h, state = ours(x, state)

    Given the same memory, both compute the same thing. What they *keep* as
    memory differs in one configuration, ``layer_norm=True,
    normalize_after=False``: the reference's ``saved_inputs`` are the raw layer
    inputs, while srupp's state keeps the normalised ones (the inputs its
    attention actually reads), so carrying memory from segment to segment
    gives different results there. Feeding the reference's raw
    ``saved_inputs`` to srupp as memory reproduces the reference.
    """
    kind = _reference_kind(module)
    if kind in ("SRU", "SRUCell") and (causal or mem_len is not None):
        raise ValueError(f"causal and mem_len apply to SRU++ only, not to sru.{kind}")
    device, dtype = _device_dtype(module)
    factory = {"device": device, "dtype": dtype}
    if kind == "SRU":
        ours = _convert_sru(module, batch_first, factory)
    elif kind == "SRUpp":
        ours = _convert_srupp(module, batch_first, causal, mem_len, factory)
    elif kind == "SRUCell":
        ours = snn.SRUCell(**_sru_cell_config(module), batch_first=batch_first, **factory)
        _copy_sru_cell(ours, module)
    else:
        ours = snn.SRUppLayer(**_srupp_cell_config(module), causal=causal, mem_len=mem_len,
                              batch_first=batch_first, **factory)
        _copy_srupp_cell(ours, module)
    ours.train(module.training)
    return ours


# --------------------------------------------------------------------------- detection

def _reference_kind(module: Any) -> str:
    cls = type(module)
    if _class_name(module) not in _KINDS:
        raise ValueError(
            f"from_sru expects an instance of sru.SRU, sru.SRUpp, sru.SRUCell or "
            f"sru.SRUppCell (package sru==3.0.0.dev6), got {cls.__module__}.{cls.__name__}")
    return cls.__name__


def _class_name(m: Any) -> str:
    """Name of a reference class, or '' for a class from elsewhere."""
    cls = type(m)
    return cls.__name__ if (cls.__module__ or "").split(".")[0] == "sru" else ""


def _device_dtype(module: nn.Module):
    params = list(module.parameters())
    if not params:
        raise ValueError("the reference module has no parameters")
    devices = {p.device for p in params}
    dtypes = {p.dtype for p in params}
    if len(devices) > 1 or len(dtypes) > 1:
        raise ValueError(f"the reference module's parameters must share one device and one "
                         f"dtype, got devices {sorted(map(str, devices))} and dtypes "
                         f"{sorted(map(str, dtypes))}")
    if not params[0].is_floating_point():
        raise ValueError(f"the reference module's parameters must be floating point, "
                         f"got {params[0].dtype}")
    return params[0].device, params[0].dtype


def _check_plain_linear(m: Any, in_features: int, out_features: int, what: str):
    if type(m) is not nn.Linear or m.bias is not None or m.in_features != in_features \
            or m.out_features != out_features:
        raise ValueError(f"{what}: expected a bias-free nn.Linear({in_features}, {out_features}), "
                         f"got {m!r}")


def _check_cell_common(cell: Any, where: str):
    if getattr(cell, "v1", False):
        raise ValueError(f"{where}: v1=True (the deprecated SRU v1) is not supported")
    if getattr(cell, "activation_type", 0) != 0:
        raise ValueError(f"{where}: use_tanh=True (activation {cell.activation!r}) is not "
                         f"supported; srupp has no activation on c")
    _check_layer_norm(cell.layer_norm, where)


def _check_layer_norm(ln: Any, where: str):
    if ln is not None and (type(ln) is not nn.LayerNorm or ln.weight is None
                           or ln.bias is None):
        raise ValueError(f"{where}: unsupported layer_norm module {ln!r}")


# --------------------------------------------------------------------------- configs

def _sru_cell_config(cell: Any, where: str = "sru.SRUCell") -> Dict[str, Any]:
    """Keyword arguments of srupp.nn.SRUCell for a reference SRUCell; checks its transform."""
    _check_cell_common(cell, where)
    D, k = cell.output_size, cell.num_matrices
    t = cell.transform_module
    proj = int(cell.projection_size)
    if proj == 0:
        _check_plain_linear(t, cell.input_size, D * k, f"{where}.transform_module (custom "
                            f"transform_module is not supported)")
    else:
        if type(t) is not nn.Sequential or len(t) != 2:
            raise ValueError(f"{where}: custom transform_module is not supported, got {t!r}")
        _check_plain_linear(t[0], cell.input_size, proj, f"{where}.transform_module[0]")
        _check_plain_linear(t[1], proj, D * k, f"{where}.transform_module[1]")
    return dict(
        input_size=cell.input_size, hidden_size=cell.hidden_size, dropout=float(cell.dropout),
        rnn_dropout=float(cell.rnn_dropout), bidirectional=bool(cell.bidirectional),
        projection_size=proj, highway_bias=float(cell.highway_bias),
        layer_norm=cell.layer_norm is not None, normalize_after=bool(cell.normalize_after),
        rescale=bool(cell.rescale), has_skip_term=bool(cell.has_skip_term),
        weight_c_init=float(cell.weight_c_init),
    )


def _srupp_transform_info(cell: Any, where: str) -> Dict[str, Any]:
    """What a reference SRU++ layer's transform is: attention or projected linear, and its sizes."""
    t = cell.transform_module
    name = _class_name(t)
    D, k = cell.output_size, cell.num_matrices
    if name not in ("SRUppAttention", "SRUppProjectedLinear"):
        raise ValueError(f"{where}: custom transform_module {type(t).__name__} is not supported "
                         f"(expected SRUppAttention or SRUppProjectedLinear)")
    d_proj = t.proj_features
    _check_plain_linear(t.linear1, cell.input_size, d_proj, f"{where}.transform_module.linear1")
    ln = t.layer_norm
    _check_layer_norm(ln, f"{where}.transform_module")
    info = dict(proj_size=d_proj, dropout=float(t.dropout.p), attn_dropout=0.0, num_heads=1,
                attn_layer_norm=ln is not None, use_attention=name == "SRUppAttention")
    if info["use_attention"]:
        _check_plain_linear(t.linear2, d_proj, 2 * d_proj, f"{where}.transform_module.linear2")
        _check_plain_linear(t.linear3, d_proj, D * k, f"{where}.transform_module.linear3")
        if ln is not None and not t.normalize_after:
            raise ValueError(f"{where}: SRUppAttention with normalize_after=False (pre-norm "
                             f"inside the attention) is not supported")
        if tuple(t.alpha.shape) != (1,):
            raise ValueError(f"{where}: alpha must have shape (1,), got {tuple(t.alpha.shape)}")
        info.update(num_heads=int(t.num_heads), attn_dropout=float(t.attn_dropout))
    else:
        _check_plain_linear(t.linear2, d_proj, D * k, f"{where}.transform_module.linear2")
    return info


def _srupp_cell_config(cell: Any, where: str = "sru.SRUppCell") -> Dict[str, Any]:
    """Keyword arguments of srupp.nn.SRUppLayer for a reference SRUppCell."""
    _check_cell_common(cell, where)
    if not cell.has_skip_term:
        raise ValueError(f"{where}: has_skip_term=False is not supported for SRU++ layers")
    if cell.rnn_dropout > 0:
        raise ValueError(f"{where}: rnn_dropout > 0 is not supported for SRU++ layers")
    return dict(
        input_size=cell.input_size, hidden_size=cell.hidden_size,
        **_srupp_transform_info(cell, where), bidirectional=bool(cell.bidirectional),
        layer_norm=cell.layer_norm is not None, normalize_after=bool(cell.normalize_after),
        highway_bias=float(cell.highway_bias), rescale=bool(cell.rescale),
        weight_c_init=float(cell.weight_c_init), highway_dropout=float(cell.dropout),
    )


def _attention_layout(flags: List[bool]) -> Dict[str, int]:
    """The srupp SRUpp argument that gives attention exactly to the layers in ``flags``."""
    n = len(flags)
    for every in range(1, n + 2):  # n + 1: no layer has attention
        if all(((i + 1) % every == 0) == f for i, f in enumerate(flags)):
            return {"attention_every_n_layers": every}
    for last in range(1, n + 1):
        if all((n - i <= last) == f for i, f in enumerate(flags)):
            return {"attention_last_n_layers": last}
    pattern = "".join("A" if f else "-" for f in flags)
    raise ValueError(f"the reference's attention layout {pattern!r} (A: attention) fits neither "
                     f"attention_every_n_layers nor attention_last_n_layers")


def _check_layers_agree(ours: List[Any], config: List[Dict[str, Any]], kind: str):
    """Each layer of the new stack must be configured like the reference's."""
    for i, (o, cfg) in enumerate(zip(ours, config)):
        for key, want in cfg.items():
            if key == "highway_dropout":
                got = o.highway_dropout
            elif key == "dropout":
                got = o.transform.dropout.p if kind == "SRUpp" else o.highway_dropout
            elif key == "layer_norm":
                got = o.layer_norm is not None
            elif key == "attn_layer_norm":
                got = o.transform.layer_norm is not None
            elif key == "num_heads":
                got = o.transform.num_heads if o.use_attention else want
            elif key == "attn_dropout":
                got = o.transform.attn_dropout if o.use_attention else want
            elif key in ("highway_bias", "weight_c_init"):
                continue  # initial values only; the weights are copied
            else:
                got = getattr(o, key)
            if got != want:
                raise ValueError(
                    f"layer {i} of the reference {kind} has {key}={want!r}, unlike the rest of "
                    f"the stack ({got!r}); srupp's {kind} cannot express that")


# --------------------------------------------------------------------------- stacks

def _convert_sru(ref: Any, batch_first: bool, factory) -> nn.Module:
    cells = list(ref.rnn_lst)
    configs = [_sru_cell_config(c, f"sru.SRU layer {i}") for i, c in enumerate(cells)]
    first = configs[0]
    sizes = [cfg["projection_size"] for cfg in configs]
    ours = snn.SRU(
        ref.input_size, ref.hidden_size, ref.num_layers,
        dropout=float(ref.dropout), rnn_dropout=first["rnn_dropout"],
        bidirectional=bool(ref.bidirectional),
        projection_size=sizes[0] if len(set(sizes)) == 1 else sizes,
        highway_bias=first["highway_bias"], layer_norm=first["layer_norm"],
        normalize_after=first["normalize_after"], has_skip_term=first["has_skip_term"],
        rescale=first["rescale"], nn_rnn_compatible_return=bool(ref.nn_rnn_compatible_return),
        proj_input_to_hidden_first=ref.input_to_hidden is not None,
        weight_c_init=first["weight_c_init"], batch_first=batch_first, **factory)
    return _copy_stack(ours, ref, cells, configs, "SRU", _copy_sru_cell)


def _convert_srupp(ref: Any, batch_first: bool, causal: bool, mem_len: Optional[int],
                   factory) -> nn.Module:
    if ref.nn_rnn_compatible_return:
        raise ValueError("sru.SRUpp with nn_rnn_compatible_return=True is not supported: "
                         "srupp's SRUpp returns an SRUppState (reshape state.c yourself)")
    cells = list(ref.rnn_lst)
    configs = [_srupp_cell_config(c, f"sru.SRUpp layer {i}") for i, c in enumerate(cells)]
    first = configs[0]
    attn = [cfg for cfg in configs if cfg["use_attention"]]
    layout = _attention_layout([cfg["use_attention"] for cfg in configs])
    ours = snn.SRUpp(
        ref.input_size, ref.hidden_size, first["proj_size"], ref.num_layers,
        dropout=first["dropout"], attn_dropout=attn[0]["attn_dropout"] if attn else 0.0,
        num_heads=attn[0]["num_heads"] if attn else 1, bidirectional=bool(ref.bidirectional),
        layer_norm=first["layer_norm"], normalize_after=first["normalize_after"],
        attn_layer_norm=first["attn_layer_norm"], highway_bias=first["highway_bias"],
        rescale=first["rescale"], proj_input_to_hidden_first=ref.input_to_hidden is not None,
        weight_c_init=first["weight_c_init"], causal=causal, mem_len=mem_len,
        batch_first=batch_first, **layout, **factory)
    return _copy_stack(ours, ref, cells, configs, "SRUpp", _copy_srupp_cell)


def _copy_stack(ours: nn.Module, ref: Any, cells: List[Any], configs: List[Dict[str, Any]],
                kind: str, copy_cell) -> nn.Module:
    """Check that the new stack's layers match the reference's, then copy every weight."""
    if ref.input_to_hidden is not None:
        _check_plain_linear(ref.input_to_hidden, ref.input_size, ref.output_size,
                            "input_to_hidden")
    _check_layers_agree(list(ours.layers), configs, kind)
    if ref.input_to_hidden is not None:
        _copy(ours.input_to_hidden.weight, ref.input_to_hidden.weight, "input_to_hidden")
    for o, r in zip(ours.layers, cells):
        copy_cell(o, r)
    return ours


# --------------------------------------------------------------------------- weights

@torch.no_grad()
def _copy(dst: Tensor, src: Tensor, what: str, layout=None):
    """dst <- layout(src) (or src), with src's requires_grad flag."""
    value = src if layout is None else layout(src)
    if dst.shape != value.shape:
        raise ValueError(f"{what}: shape {tuple(src.shape)} in the reference does not give "
                         f"the expected {tuple(dst.shape)}")
    dst.copy_(value)
    dst.requires_grad_(src.requires_grad)


def _planar(k: int, D: int):
    """Layout of the map producing U: rows from interleaved (u·k + m) to planar (m·D + u)."""
    def layout(weight: Tensor) -> Tensor:
        if weight.shape[0] != k * D:
            return weight  # the shape check in _copy reports it
        n = weight.shape[1]
        return weight.reshape(D, k, n).transpose(0, 1).reshape(k * D, n)
    return layout


def _copy_gates(ours: Any, ref: Any):
    two_rows = lambda t: t.reshape(2, -1)  # noqa: E731  flat [v_f | v_r] -> (2, D)
    _copy(ours.weight_c, ref.weight_c, "weight_c", two_rows)
    _copy(ours.bias, ref.bias, "bias", two_rows)
    _copy_layer_norm(ours.layer_norm, ref.layer_norm)
    if ref.rescale and ref.has_skip_term:
        ours.scale_x = float(ref.scale_x.reshape(-1)[0])  # the buffer the reference uses


def _copy_layer_norm(ours: Optional[nn.LayerNorm], ref: Optional[nn.LayerNorm]):
    if ref is None:
        return
    _copy(ours.weight, ref.weight, "layer_norm.weight")
    _copy(ours.bias, ref.bias, "layer_norm.bias")
    ours.eps = ref.eps


def _copy_sru_cell(ours: Any, ref: Any):
    _copy_gates(ours, ref)
    planar = _planar(ours.num_matrices, ours.output_size)
    t_ref = ref.transform_module
    if isinstance(t_ref, nn.Sequential):
        _copy(ours.transform[0].weight, t_ref[0].weight, "transform_module[0]")
        _copy(ours.transform[1].weight, t_ref[1].weight, "transform_module[1]", planar)
    else:
        _copy(ours.transform.weight, t_ref.weight, "transform_module", planar)


def _copy_srupp_cell(ours: Any, ref: Any):
    _copy_gates(ours, ref)
    planar = _planar(ours.num_matrices, ours.output_size)
    t_ours, t_ref = ours.transform, ref.transform_module
    _copy(t_ours.linear1.weight, t_ref.linear1.weight, "linear1")
    _copy(t_ours.linear2.weight, t_ref.linear2.weight, "linear2",
          None if ours.use_attention else planar)
    if ours.use_attention:
        _copy(t_ours.linear3.weight, t_ref.linear3.weight, "linear3", planar)
        _copy(t_ours.alpha, t_ref.alpha, "alpha")
    _copy_layer_norm(t_ours.layer_norm, t_ref.layer_norm)
