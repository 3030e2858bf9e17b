"""A trained model applied to new text: generation, translation, classification.

    run = load_run("runs/shakespeare")              # config, tokenizer, model, checkpoint
    generate_text(run.model, run.tokenizer, "ROMEO.", 200, temperature=0.8).text
    translate_lines(model, tokenizer, ["ein haus"], beam=5)          # -> ["a house"]
    classify_lines(model, tokenizer, ["a text"])                     # -> (1, C) probabilities

The CLI's ``generate``, ``translate`` and ``classify`` commands, the
evaluation of the tasks (:mod:`srupp.train`) and the Hugging Face export
call these. Beside them, what training and evaluation share with inference:
texts as token ids (:func:`encode_lines`, :func:`fit_length`), batches of
similar lengths (:func:`length_batches`, :func:`pad_batch`, :func:`to_device`)
and the precision (:func:`autocast_context`).

This module sits above :mod:`srupp.models` and :mod:`srupp.data` and below
:mod:`srupp.train`. Bad arguments raise ``ValueError``/``TypeError`` in the
terms of this API; a damaged run directory is a :class:`~srupp.errors.UserError`.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from pathlib import Path
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import runs
from ._ranges import check
from .data import LengthBatcher, tokenizer_from_dict
from .errors import UserError
from .models import load_model
from .models.decoding import beam_search, greedy_decode

# --------------------------------------------------------------------------- runs


class Run(NamedTuple):
    """What inference needs from a run (unpacks as ``config, tokenizer, model, checkpoint``)."""

    config: dict          # the run config as saved ({} for a checkpoint folder on its own)
    tokenizer: Any        # srupp.data tokenizer
    model: Any            # the model, in eval mode
    checkpoint: Path      # the checkpoint folder it was loaded from


def load_run(path: Union[str, Path], *, device="cpu", prefer: str = "best") -> Run:
    """The model and tokenizer of a run directory (its ``prefer`` checkpoint, else
    last, else best) or of a checkpoint folder, on ``device``, in eval mode."""
    ckpt = runs.resolve_checkpoint(path, prefer=prefer)
    try:
        tokenizer = tokenizer_from_dict(runs.tokenizer_json(ckpt))
    except (ValueError, TypeError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"{ckpt / runs.TOKENIZER} is damaged ({e})") from None
    model = load_model(ckpt, device=device)
    if model.config.vocab_size != tokenizer.vocab_size:
        raise UserError(f"{ckpt}: the model's vocabulary ({model.config.vocab_size}) does not "
                        f"match its tokenizer ({tokenizer.vocab_size}); the run is damaged")
    return Run(runs.run_config(ckpt), tokenizer, model, ckpt)


def checked_labels(ckpt: Path, model) -> List[str]:
    """A classifier's labels (``labels.json`` of its checkpoint folder), one per output."""
    labels = runs.load_labels(ckpt)
    if len(labels) != model.config.num_labels:
        raise UserError(f"{ckpt}: labels.json lists {len(labels)} labels, the model has "
                        f"{model.config.num_labels} outputs; the run is damaged")
    return labels


# --------------------------------------------------------------------------- shared helpers


def autocast_context(precision: str, device: str):
    """The autocast context for a precision name ("fp32", "bf16", "fp16")."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device, dtype=dtype)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t``, a batch built on the host, on ``device``.

    To CUDA the copy goes from pinned (page-locked) memory and does not block:
    from pageable memory CUDA first waits for the device. Pinning copies ``t``
    once more on the host, which is cheap for batches of token ids; the pinned
    buffer is kept by PyTorch's host allocator until the copy has run. Any
    other target is a plain ``t.to(device)``.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def encode_lines(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """Each text's ids; word and subword tokenizers end each with ``<eos>``.

    Line tokenizers encode all texts in one call (a text holds no newline: a
    TSV field cannot) and the result is cut at ``<eos>``.
    """
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        return [tokenizer.encode(t).tolist() for t in texts]
    if not texts:
        return []
    # a final "\n" ends the last line without starting another: one line per text,
    # an empty last text included
    ids = tokenizer.encode("\n".join(texts) + "\n").tolist()
    out, start = [], 0
    for i, t in enumerate(ids):
        if t == eos:
            out.append(ids[start:i + 1])
            start = i + 1
    if len(out) != len(texts):  # a text held a newline after all
        raise ValueError("a text holds a line break; give one text per line")
    return out


def fit_length(seqs: List[List[int]], limit: int, *, truncate: bool, where: str,
               keep_last: bool = True) -> List[List[int]]:
    """Sequences longer than ``limit``: a ValueError, or cut (the count warned) when ``truncate``.

    A cut sequence keeps its last token (``<eos>``) when ``keep_last``.
    """
    long = [i for i, s in enumerate(seqs) if len(s) > limit]
    if not long:
        return seqs
    if not truncate:
        raise ValueError(f"{len(long)} sentence(s) of {where} are longer than "
                         f"data.max_len={limit} tokens (the first is number {long[0] + 1}, "
                         f"{len(seqs[long[0]])} tokens); raise data.max_len, or set "
                         f"data.truncate=true to cut them")
    warnings.warn(f"{len(long)} sentence(s) of {where} cut to data.max_len={limit} tokens",
                  stacklevel=2)
    cut = (lambda s: s[:limit - 1] + s[-1:]) if keep_last else (lambda s: s[:limit])
    return [cut(s) if len(s) > limit else s for s in seqs]


def length_batches(lengths: Sequence[int], max_tokens: int,
                   max_batches: Optional[int] = None) -> List[List[int]]:
    """Fixed batches of similar lengths, for evaluation and inference.

    With ``max_batches``, a fixed random choice of that many: the first
    batches in length order would hold only the shortest sentences.
    """
    if not lengths:
        return []
    batches = LengthBatcher(lengths, max_tokens, shuffle=False).batches()
    if max_batches is not None and max_batches < len(batches):
        chosen = sorted(random.Random(0).sample(range(len(batches)), max_batches))
        batches = [batches[i] for i in chosen]
    return batches


def pad_batch(seqs: Sequence[Sequence[int]], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, L) and their padding mask (B, L), True at padding."""
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, L, dtype=torch.long)
    pad = torch.ones(B, L, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        pad[b, :len(s)] = False
    return to_device(ids, device), to_device(pad, device)


# --------------------------------------------------------------------------- generation


class Generation(NamedTuple):
    text: str            # the new text (the prompt excluded)
    prompt_tokens: int
    new_tokens: int


#: ``--dtype`` of ``srupp generate`` and ``srupp serve``: the weights while decoding.
DECODING_DTYPES = ("fp32", "bf16", "int8", "w8a8")


def weights_for_decoding(model, dtype: str) -> str:
    """Convert ``model`` in place to the weights of ``dtype`` (one of :data:`DECODING_DTYPES`)
    and return the dtype it computes in: fp32; bf16 (a UserError on a CPU without bf16
    instructions, where it would be emulated and slower); int8 and w8a8 compute in bf16
    where the CPU has bf16 instructions, else fp32. ``srupp generate`` and ``srupp serve``
    both call it, so that the two give the same text."""
    from .ops.settings import cpu_has_native_bf16

    if dtype not in DECODING_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DECODING_DTYPES)}, got {dtype!r}")
    native = model.device.type != "cpu" or cpu_has_native_bf16()
    if dtype == "bf16" and not native:
        raise UserError("--dtype bf16: this CPU has no bf16 instructions (AVX-512 BF16 or "
                        "AMX), so bf16 would be emulated and slower; use --dtype fp32")
    return weights_in(model, dtype, "bf16" if native else "fp32")


def weights_in(model, dtype: str, int8_activations: str) -> str:
    """Convert ``model`` in place to the weights of ``dtype`` (fp32, bf16, or int8 and
    w8a8, whose float work runs in ``int8_activations``); returns the dtype the model
    computes in."""
    if dtype in ("int8", "w8a8"):
        model.quantize(dtype)
        dtype = int8_activations
    if dtype == "bf16":
        model.to(torch.bfloat16)  # the recurrent state c stays fp32
    return dtype


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, mem_len: Optional[int] = None,
                  seed: int = 0, stop: Sequence[str] = (),
                  on_text: Optional[Callable[[str], None]] = None) -> Generation:
    """Continue ``prompt`` with a language model, sampling with a generator seeded by ``seed``.

    It runs the serving engine (:class:`srupp.engine.Engine`) with one stream, so
    ``srupp generate`` and ``srupp serve`` give the same text for the same settings.
    ``on_text`` is called with each new piece of text as it is decoded (for
    streaming); the pieces together are the returned ``text``. The sampling
    arguments are the model's ``generate``'s (temperature 0 is greedy); the text
    ends before the first of the ``stop`` strings.
    """
    from .engine import Engine, Sampling

    prompt_ids = tokenizer.encode(prompt).tolist()
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one character")
    sampling = Sampling(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, stop=tuple(stop))
    engine = Engine(model, tokenizer, max_streams=1, window=mem_len,
                    max_prompt_tokens=max(len(prompt_ids), 1),
                    eos_id=getattr(tokenizer, "eos_id", None))
    callback = None if on_text is None else (lambda ev: ev.text and on_text(ev.text))
    stream = engine.generate(prompt_ids, sampling, on_event=callback)
    return Generation(stream.text, len(prompt_ids), len(stream.generated))


# --------------------------------------------------------------------------- translation


def encode_sources(tokenizer, lines: Sequence[str], *, max_len: Optional[int] = None,
                   truncate: bool = False, first_line: int = 1) -> List[List[int]]:
    """The source ids of each line ([] for a blank one), checked against ``max_len``.

    A longer source is a ValueError naming its line (``first_line`` is the
    number of ``lines[0]``), or is cut to ``max_len``, with a warning, when
    ``truncate``.
    """
    check("max_len", max_len, ">= 1", integer=True)
    out: List[List[int]] = [[] for _ in lines]
    todo = [i for i, ln in enumerate(lines) if ln.strip()]
    src = encode_lines(tokenizer, [lines[i] for i in todo])
    if max_len is not None:
        long = [k for k, s in enumerate(src) if len(s) > max_len]
        if long and not truncate:
            raise ValueError(f"line {first_line + todo[long[0]]} has {len(src[long[0]])} source "
                             f"tokens, more than the model's max_len={max_len}; shorten it, "
                             f"or truncate")
        src = fit_length(src, max_len, truncate=True, where="the input")
    for i, s in zip(todo, src):
        out[i] = s
    return out


@torch.no_grad()
def translate_ids(model, sources: Sequence[Sequence[int]], *, beam: int = 5, lenpen: float = 1.0,
                  max_len_a: float = 1.2, max_len_b: int = 10, no_repeat_ngram_size: int = 0,
                  max_tokens: int = 4096, precision: str = "fp32") -> List[List[int]]:
    """The translations' ids (EOS excluded) of sources given as ids; [] for an empty source.

    Sources are batched by length (at most ``max_tokens`` padded source
    tokens per batch) and decoded greedily (``beam`` 1) or with beam search;
    ``no_repeat_ngram_size`` n > 0 bans repeating an n-gram of the output
    (:mod:`srupp.models.decoding`).
    """
    check("beam", beam, ">= 1", integer=True)
    check("lenpen", lenpen, ">= 0")  # beam_search's, checked for greedy (beam 1) too
    check("no_repeat_ngram_size", no_repeat_ngram_size, ">= 0", integer=True)
    out: List[List[int]] = [[] for _ in sources]
    todo = [i for i, s in enumerate(sources) if s]
    device = model.device
    for idx in length_batches([len(sources[i]) for i in todo], max_tokens):
        ids, pad = pad_batch([sources[todo[k]] for k in idx], device)
        with autocast_context(precision, device.type):
            if beam == 1:
                hyps = greedy_decode(model, ids, pad, max_len_a=max_len_a, max_len_b=max_len_b,
                                     no_repeat_ngram_size=no_repeat_ngram_size)
            else:
                hyps = beam_search(model, ids, pad, beam=beam, lenpen=lenpen,
                                   max_len_a=max_len_a, max_len_b=max_len_b,
                                   no_repeat_ngram_size=no_repeat_ngram_size)
        for k, h in zip(idx, hyps):
            out[todo[k]] = h.tokens
    return out


def translate_lines(model, tokenizer, lines: Sequence[str], *, beam: int = 5,
                    lenpen: float = 1.0, max_len_a: float = 1.2, max_len_b: int = 10,
                    no_repeat_ngram_size: int = 0, max_tokens: int = 4096,
                    max_len: Optional[int] = None, truncate: bool = False,
                    precision: str = "fp32", first_line: int = 1) -> List[str]:
    """Translate ``lines`` (in order); an empty line gives an empty translation.

    See :func:`encode_sources` (the length limit) and :func:`translate_ids`
    (batching, search, ``no_repeat_ngram_size``); the translations are detokenised.
    """
    check("beam", beam, ">= 1", integer=True)  # named before any text is encoded
    check("lenpen", lenpen, ">= 0")
    check("no_repeat_ngram_size", no_repeat_ngram_size, ">= 0", integer=True)
    sources = encode_sources(tokenizer, lines, max_len=max_len, truncate=truncate,
                             first_line=first_line)
    return [tokenizer.decode(ids) for ids in translate_ids(
        model, sources, beam=beam, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
        no_repeat_ngram_size=no_repeat_ngram_size, max_tokens=max_tokens,
        precision=precision)]


# --------------------------------------------------------------------------- classification


@torch.no_grad()
def predict(model, items: Sequence[Sequence[int]], *, max_tokens: int = 4096,
            precision: str = "fp32") -> torch.Tensor:
    """Class probabilities (N, C) of texts given as token ids, in their order."""
    if not items:
        return torch.empty(0, model.config.num_labels)
    was_training = model.training
    model.eval()
    device = model.device
    probs: List[Optional[torch.Tensor]] = [None] * len(items)
    try:
        for idx in length_batches([len(x) for x in items], max_tokens):
            tokens, pad = pad_batch([items[i] for i in idx], device)
            with autocast_context(precision, device.type):
                logits = model(tokens, mask_pad=pad).logits  # (B, C)
            for i, p in zip(idx, logits.float().softmax(-1).cpu()):
                probs[i] = p
    finally:
        model.train(was_training)
    return torch.stack(probs)


def encode_texts(tokenizer, lines: Sequence[str], *, max_len: int, truncate: bool = False,
                 where: str = "the input") -> List[List[int]]:
    """The ids of texts to classify, at most ``max_len`` each (see :func:`fit_length`).

    An empty line is classified as an empty text: its ``<eos>`` alone for the
    tokenizers that end each line with one (word, SentencePiece), id 0 for the
    byte- and character-level ones.
    """
    ids = [x or [0] for x in encode_lines(tokenizer, lines)]
    return fit_length(ids, max_len, truncate=truncate, where=where, keep_last=False)


def classify_lines(model, tokenizer, lines: Sequence[str], *, max_len: int = 256,
                   truncate: bool = False, max_tokens: int = 4096,
                   where: str = "the input") -> torch.Tensor:
    """Class probabilities (N, C) of ``lines``, in their order (see :func:`encode_texts`)."""
    return predict(model, encode_texts(tokenizer, lines, max_len=max_len, truncate=truncate,
                                       where=where), max_tokens=max_tokens)
