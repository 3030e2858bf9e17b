"""Hugging Face ``transformers`` classes for srupp's language models (``pip install 'srupp[hf]'``).

Four pieces, registered with transformers' Auto classes (model type ``"srupp"``)
when this module is imported:

- :class:`SRUppHFConfig`: a ``PreTrainedConfig`` that holds the srupp model
  config (``LMConfig.to_dict()``) in its ``srupp`` field.
- :class:`SRUppForCausalLM`: a ``PreTrainedModel`` with ``generate()`` around
  any srupp language model (``self.model``: SRU++, or a baseline).
- :class:`SRUppCache`: the recurrent state as ``generate()``'s cache. After the
  prompt, each step feeds only the new token and the state; the prefix is never
  recomputed. Beam search reorders the state with its ``index_select``.
- :class:`SRUppTokenizer`: a ``PreTrainedTokenizer`` around a srupp tokenizer
  (byte, char, word or SentencePiece), with exactly its ids and text.

Registration is explicit, as in flash-linear-attention: ``import srupp`` alone
does not import transformers (it stays light), and ``import srupp.hf`` is what
makes the model type known::

    import srupp.hf  # noqa: F401  (registers model type "srupp" with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(folder)   # no trust_remote_code
    pipe = pipeline("text-generation", model=folder)

where ``folder`` was written by :func:`export_run_to_hf` (a training run) or by
``SRUppForCausalLM.save_pretrained`` and ``SRUppTokenizer.save_pretrained``.

Weights are saved as safetensors under the srupp model's own parameter names
behind ``model.``; tied weights (``tie_embeddings``, including an adaptive
softmax's clusters and projections) are stored once and tied again on loading.
It needs transformers 5; other major versions are refused on import.
"""

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import runs
from ._extras import MissingExtra, install_hint, require
from ._files import atomic_write_text, write_error
from .data.tokenizers import (ByteTokenizer, CharTokenizer, SentencePieceTokenizer, Tokenizer,
                              WordTokenizer, tokenizer_from_dict)
from .errors import UserError
from .inference import load_run
from .models import LMConfig, SRUppConfig, build_model, config_from_dict
from .nn.adaptive import AdaptiveInput, ProjectedAdaptiveLogSoftmax

transformers = require("transformers", "hf", "srupp's Hugging Face integration")
# The generate() and cache API this module follows is transformers 5's.
if transformers.__version__.split(".")[0] != "5":
    raise MissingExtra(f"srupp's Hugging Face integration needs transformers 5 (found "
                       f"{transformers.__version__}): {install_hint('transformers')}",
                       name="transformers")

from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer,  # noqa: E402
                          GenerationMixin, PreTrainedConfig, PreTrainedModel,
                          PreTrainedTokenizer)
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

__all__ = ["SRUppHFConfig", "SRUppForCausalLM", "SRUppCache", "SRUppTokenizer",
           "export_run_to_hf"]

MODEL_TYPE = "srupp"
TOKENIZER_FILE = "srupp_tokenizer.json"  # the srupp tokenizer's to_dict(), as in a run
# Padding reuses id 0, a token of every srupp tokenizer that carries no text: <unk>
# (char, word, SentencePiece) or the NUL byte. <eos>, the GPT-2 choice, is a line
# end here, and decoding with skip_special_tokens would drop every newline.
PAD_ID = 0


# ------------------------------------------------------------------ config
class SRUppHFConfig(PreTrainedConfig):
    """The transformers config of a srupp language model.

    Not named ``SRUppConfig``: that is the srupp model config it holds
    (:class:`srupp.models.SRUppConfig`).

    Args:
        srupp: the srupp model config as a dict (``LMConfig.to_dict()``: its
            ``type`` and fields); None gives srupp's default SRU++ model.
        vocab_size, tie_word_embeddings: read from ``srupp`` (the names
            transformers looks for); giving a different value is an error.
        use_cache: ``generate()`` carries the recurrent state (keep True).
        pad_token_id: the id a batch of prompts is padded with (the
            :class:`SRUppTokenizer`'s ``pad_token``); padding is masked.
    """

    model_type = MODEL_TYPE

    srupp: Optional[dict] = None
    vocab_size: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    use_cache: bool = True
    pad_token_id: Optional[int] = PAD_ID

    def __post_init__(self, **kwargs):
        if self.srupp is None:
            self.srupp = SRUppConfig().to_dict()
        lm = self.srupp_config()
        self.srupp = lm.to_dict()  # every field spelled out, as config.json keeps it
        for name, value in (("vocab_size", lm.vocab_size),
                            ("tie_word_embeddings", lm.tie_embeddings)):
            given = getattr(self, name)
            if given is not None and given != value:
                raise ValueError(f"SRUppHFConfig: {name}={given!r} disagrees with the srupp "
                                 f"config ({value!r}); leave {name} out, it is read from srupp")
            setattr(self, name, value)
        super().__post_init__(**kwargs)

    def srupp_config(self) -> LMConfig:
        """The srupp model config (a fresh :class:`~srupp.models.LMConfig` subclass)."""
        if not isinstance(self.srupp, dict):
            raise TypeError(f"SRUppHFConfig.srupp must be a dict (a srupp LMConfig.to_dict()), "
                            f"got {type(self.srupp).__name__}")
        config = config_from_dict(self.srupp)
        if not isinstance(config, LMConfig):
            raise ValueError(f"SRUppHFConfig holds a language model, but srupp is a "
                             f"{getattr(config, 'task', '?')} config; export a language model")
        return config


# ------------------------------------------------------------------- cache
class SRUppCache:
    """The state of a srupp language model, as ``generate()``'s ``past_key_values``.

    ``state`` is what the srupp model's ``forward``/``step`` return (an
    :class:`~srupp.nn.SRUppState`, or a TensorState for the baselines), after
    ``seen_tokens`` tokens per row. It is updated in place by each forward,
    like transformers' own caches. A recurrent state cannot forget tokens, so
    there is no ``crop`` (assisted generation is refused for this model).
    """

    # what generate() asks every cache: never compiled, never cropped
    is_compileable = False
    is_croppable = False

    def __init__(self, state: Any, seen_tokens: int = 0):
        self.state = state
        self.seen_tokens = seen_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens per row already folded into the state (generate() skips them)."""
        return self.seen_tokens

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Follow beam search: row i of the state becomes old row ``beam_idx[i]``."""
        self.state = self.state.index_select(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.state = self.state.index_select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = torch.arange(self.state.batch_size).repeat_interleave(repeats)
        self.state = self.state.index_select(rows)

    def crop(self, max_length: int) -> None:
        raise ValueError("a srupp state cannot drop tokens it has read (it is recurrent); "
                         "generate without assistant_model or prompt_lookup_num_tokens")

    def __repr__(self) -> str:
        return (f"SRUppCache({type(self.state).__name__}, batch={self.state.batch_size}, "
                f"seen_tokens={self.seen_tokens})")


# ------------------------------------------------------------------- model
def _tied_weights(model: nn.Module, prefix: str) -> Dict[str, str]:
    """``{target: source}`` for every parameter registered under a second name.

    The names are exact regular expressions (transformers matches these keys as
    patterns): ``out_embs.1`` must not also match ``out_embs.10``.
    """
    first: Dict[int, str] = {}
    tied: Dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied["^" + re.escape(prefix + name) + "$"] = "^" + re.escape(first[id(p)]) + "$"
        else:
            first[id(p)] = prefix + name
    return tied


# The output field generate() reads the state back from: `cache` in later
# transformers 5 releases, `past_key_values` in earlier ones.
_OUTPUT_CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
                       else "past_key_values")


class SRUppForCausalLM(PreTrainedModel, GenerationMixin):
    """A srupp language model (``self.model``) with transformers' saving, loading, generate().

    ``forward`` takes ``input_ids`` (B, L), ``attention_mask`` (B, >= L), 0 at
    padding (e.g. left padding for a batch of prompts), ``past_key_values`` or
    ``cache`` (a :class:`SRUppCache`: later transformers releases renamed the
    first to the second) and ``labels`` (B, L) (HF style: the inputs themselves;
    the loss scores each position's next token, -100 is ignored). It returns
    logits (B, L, V), which are log-probabilities for models with an adaptive
    softmax.
    """

    config_class = SRUppHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    # generate(): refuse assisted decoding, which must roll the cache back
    _is_stateful = True

    def __init__(self, config: SRUppHFConfig):
        super().__init__(config)
        self.model = build_model(config.srupp_config())
        # What transformers ties again after loading (tied tensors are saved once).
        self._tied_weights_keys = _tied_weights(self.model, "model.")
        self.post_init()

    @classmethod
    def from_srupp(cls, model: nn.Module) -> "SRUppForCausalLM":
        """A copy of a srupp language model (any type), ready for ``save_pretrained``."""
        if not isinstance(getattr(model, "config", None), LMConfig):
            raise TypeError(f"from_srupp takes a srupp language model (srupp.models.CausalLM), "
                            f"got {type(model).__name__}")
        hf = cls(SRUppHFConfig(srupp=model.config.to_dict()))
        p = next(model.parameters())
        hf.to(p.dtype)  # the copy keeps the weights' dtype (a bf16 model stays bf16)
        hf.model.load_state_dict(model.state_dict())
        return hf.to(p.device).train(model.training)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not make a DynamicCache: forward returns an SRUppCache

    def _prepare_attention_mask_for_generation(self, inputs_tensor: Tensor, generation_config,
                                               model_kwargs) -> Tensor:
        # Without an attention_mask, generate() would take every pad id in the prompt
        # for padding; srupp's pad id is also a real token (<unk>, the NUL byte), so
        # a prompt without a mask is all tokens. The tokenizer gives the mask.
        return torch.ones(inputs_tensor.shape[:2], dtype=torch.long, device=inputs_tensor.device)

    def _init_weights(self, module: nn.Module) -> None:
        # srupp's modules initialise their own parameters when they are built, and
        # from_pretrained loads every saved one. transformers calls this for every
        # module after loading, though, to fill what no file holds: the adaptive
        # modules' cluster bounds, a non-persistent buffer left uninitialised.
        if isinstance(module, (AdaptiveInput, ProjectedAdaptiveLogSoftmax)):
            device = module._cutoff_tensor.device
            module._cutoff_tensor = torch.tensor(module.cutoffs, device=device)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embedding

    def forward(self, input_ids: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None,
                past_key_values: Optional[SRUppCache] = None,
                labels: Optional[Tensor] = None,
                use_cache: Optional[bool] = None,
                inputs_embeds: Optional[Tensor] = None,
                output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None,
                cache: Optional[SRUppCache] = None) -> Union[CausalLMOutputWithPast, Tuple]:
        tokens = self._check_inputs(input_ids, inputs_embeds, output_attentions,
                                    output_hidden_states)
        B, L = tokens.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        # generate() passes the state as past_key_values up to transformers 5.23 and as
        # cache from 5.24 (pyproject.toml allows both): both are accepted
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the state as cache or as past_key_values, not both")
        cache = past_key_values if cache is None else cache
        if cache is not None and not isinstance(cache, SRUppCache):
            raise TypeError(f"past_key_values (cache) must be the SRUppCache this model returned, "
                            f"got {type(cache).__name__}; leave it out to start from scratch")
        if cache is not None:
            state = cache.state
        else:  # what srupp's own generate() starts from (the transformer's: an unbounded cache)
            state = self.model.generation_state(B) if use_cache else None
        mask_pad = self._padding(attention_mask, B, L)

        if cache is not None and L == 1 and mask_pad is None and labels is None:
            # one new token per row after the prompt: srupp's decoding step, as in its
            # own generate(); the prompt itself goes through forward, as there
            logits, state = self.model.step(tokens[:, 0], state)
            logits = logits.unsqueeze(1)                          # (B, 1, V)
        else:
            out = self.model(tokens, state, mask_pad=mask_pad)
            logits, state = out.logits, out.state                # (B, L, V)

        loss = None
        if labels is not None:
            # position t predicts token t+1; F.cross_entropy also fits log-probabilities
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                                   labels[:, 1:].flatten(), ignore_index=-100)
        if use_cache:
            if cache is None:
                cache = SRUppCache(state)
            cache.state, cache.seen_tokens = state, cache.seen_tokens + L
        out = CausalLMOutputWithPast(loss=loss, logits=logits,
                                     **{_OUTPUT_CACHE_FIELD: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()

    @staticmethod
    def _check_inputs(input_ids, inputs_embeds, output_attentions, output_hidden_states) -> Tensor:
        if inputs_embeds is not None:
            raise ValueError("SRUppForCausalLM takes input_ids, not inputs_embeds")
        if output_attentions or output_hidden_states:
            raise ValueError("SRUppForCausalLM returns logits only: leave output_attentions "
                             "and output_hidden_states unset")
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else input_ids
            raise ValueError(f"input_ids must be a (batch, length) tensor of token ids, got {got}")
        return input_ids

    @staticmethod
    def _padding(attention_mask: Optional[Tensor], B: int, L: int) -> Optional[Tensor]:
        """srupp's mask_pad (B, L), True at padding, for the L new tokens; None: no padding."""
        if attention_mask is None:
            return None
        # During generation the mask covers the tokens already in the state too: the
        # last L columns are the new tokens (padding inside the state is in the state).
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B or \
                attention_mask.shape[1] < L:
            raise ValueError(f"attention_mask must be (batch={B}, >= {L}) with 0 at padding, "
                             f"got {tuple(attention_mask.shape)}")
        pad = attention_mask[:, -L:] == 0
        return pad if bool(pad.any()) else None


# --------------------------------------------------------------- tokenizer
def _token_strings(tokenizer: Tokenizer) -> List[str]:
    """One distinct, readable string per id, for ``convert_ids_to_tokens``.

    Encoding and decoding go through the srupp tokenizer itself (by id), so
    these names are labels only.
    """
    n = tokenizer.vocab_size
    if isinstance(tokenizer, ByteTokenizer):  # printable ASCII as itself, other bytes <0xNN>
        return [chr(b) if 0x20 <= b < 0x7F else f"<0x{b:02X}>" for b in range(n)]
    if isinstance(tokenizer, CharTokenizer):  # single characters; id 0 is <unk>
        return [tokenizer.unk_token, *tokenizer.chars]
    if isinstance(tokenizer, WordTokenizer):
        return list(tokenizer.vocab)
    if isinstance(tokenizer, SentencePieceTokenizer):
        spm = require("sentencepiece", "subword", "a SentencePiece tokenizer")
        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(tokenizer.model_proto)
        return [sp.IdToPiece(i) for i in range(n)]
    return [f"<{tokenizer.type_name}:{i}>" for i in range(n)]  # a kind registered elsewhere


class SRUppTokenizer(PreTrainedTokenizer):
    """A srupp tokenizer (``srupp.data``) as a transformers tokenizer, with the same ids and text.

    Saved as ``srupp_tokenizer.json`` (the srupp tokenizer's ``to_dict()``,
    as in a training run) beside ``tokenizer_config.json``. It adds no special
    tokens: a prompt encodes exactly as srupp encodes it (word and
    SentencePiece tokenizers end every line, the last one too, with ``<eos>``),
    even where the text spells a special token.

    Its ``pad_token`` is id 0 (:data:`PAD_ID`: ``<unk>``, or the NUL byte of a
    byte tokenizer), and it pads on the left, as ``generate()`` wants a batch
    of prompts. Decoding with ``skip_special_tokens=True`` (what
    ``pipeline("text-generation")`` does) therefore drops id 0.

    Args:
        vocab_file: a ``srupp_tokenizer.json`` (how ``from_pretrained`` builds it).
        srupp_tokenizer: or the srupp tokenizer itself.
    """

    vocab_files_names = {"vocab_file": TOKENIZER_FILE}
    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "left"

    def __init__(self, vocab_file: Optional[str] = None, *,
                 srupp_tokenizer: Optional[Tokenizer] = None, **kwargs):
        if (vocab_file is None) == (srupp_tokenizer is None):
            raise TypeError(f"SRUppTokenizer takes vocab_file (a {TOKENIZER_FILE}) or "
                            f"srupp_tokenizer (a srupp.data tokenizer): exactly one of them")
        if srupp_tokenizer is None:
            srupp_tokenizer = tokenizer_from_dict(runs.read_json(vocab_file, "srupp tokenizer"))
        elif not isinstance(srupp_tokenizer, Tokenizer):
            raise TypeError(f"srupp_tokenizer must be a srupp.data tokenizer, got "
                            f"{type(srupp_tokenizer).__name__}")
        # set before transformers' __init__, which already asks for the vocabulary
        self.srupp_tokenizer = srupp_tokenizer
        self._pieces = _token_strings(srupp_tokenizer)
        self._piece_ids = {piece: i for i, piece in enumerate(self._pieces)}
        kwargs.setdefault("pad_token", self._pieces[PAD_ID])
        # text that spells a special token ("<unk>") is text: encode it as srupp does
        kwargs.setdefault("split_special_tokens", True)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.srupp_tokenizer.vocab_size

    def get_vocab(self) -> Dict[str, int]:
        return {**self._piece_ids, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        return [self._pieces[i] for i in self.srupp_tokenizer.encode(text).tolist()]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self._piece_ids:
            return self._piece_ids[token]
        unk = self.srupp_tokenizer.unk_id
        if unk is None:
            raise ValueError(f"{token!r} is not a token of this {self.srupp_tokenizer.type_name} "
                             f"tokenizer; tokenize text with tokenizer(text) instead")
        return unk

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= index < len(self._pieces):
            raise ValueError(f"token id {index} is outside this tokenizer's vocabulary "
                             f"(0..{len(self._pieces) - 1})")
        return self._pieces[index]

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        # by id through the srupp tokenizer: bytes become UTF-8 text, words get
        # their spaces, <eos> its newline, exactly as srupp decodes them
        return self.srupp_tokenizer.decode([self._convert_token_to_id(t) for t in tokens])

    def save_vocabulary(self, save_directory: str,
                        filename_prefix: Optional[str] = None) -> Tuple[str, ...]:
        path = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "")
                                       + TOKENIZER_FILE)
        atomic_write_text(path, json.dumps(self.srupp_tokenizer.to_dict()) + "\n")
        return (str(path),)


# ------------------------------------------------------------ registration
# Importing this module is the registration: from here on AutoConfig,
# AutoModelForCausalLM and AutoTokenizer know model type "srupp".
AutoConfig.register(MODEL_TYPE, SRUppHFConfig, exist_ok=True)
AutoModelForCausalLM.register(SRUppHFConfig, SRUppForCausalLM, exist_ok=True)
AutoTokenizer.register(SRUppHFConfig, tokenizer_class=SRUppTokenizer, exist_ok=True)


# ------------------------------------------------------------------ export
def export_run_to_hf(run_dir: Path, out_dir: Path) -> None:
    """Write a training run's language model and tokenizer as a transformers folder.

    Afterwards, with ``srupp.hf`` imported, ``AutoModelForCausalLM.from_pretrained(out_dir)``,
    ``AutoTokenizer.from_pretrained(out_dir)`` and
    ``pipeline("text-generation", model=out_dir)`` load it. The folder's
    ``README.md`` says so.

    Args:
        run_dir: a run directory (its best checkpoint, else its last) or a
            checkpoint folder (``ckpt-000500``).
        out_dir: the folder to write: new, empty, or an earlier export (replaced
            whole, so a failed export leaves the earlier one).
    Raises:
        ValueError: not a language-model checkpoint, a damaged run, or an
            ``out_dir`` that holds something else.
    """
    out_dir = Path(out_dir)
    _, tokenizer, model, ckpt = load_run(run_dir)
    if not isinstance(model.config, LMConfig):
        raise UserError(f"{ckpt} holds a {getattr(model.config, 'task', '?')} model; "
                         f"only language models export to Hugging Face")
    _check_out_dir(out_dir, ckpt)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" for one small file
    try:
        SRUppForCausalLM.from_srupp(model).save_pretrained(tmp)
        SRUppTokenizer(srupp_tokenizer=tokenizer).save_pretrained(tmp)
        atomic_write_text(tmp / "README.md", _export_readme(model.config, tokenizer))
        if out_dir.exists():  # an earlier export (checked above)
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except Exception as e:
        # a full disk: transformers and safetensors say so in their own ways
        err = write_error(e, out_dir)
        if err is None or err is e:
            raise
        raise err from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()


def _export_readme(config: LMConfig, tokenizer: Tokenizer) -> str:
    """The exported folder's README: what it holds and the import that loads it."""
    return f"""# A srupp language model for Hugging Face transformers

A `{config.type}` language model ({config.num_layers} layers, d_model {config.d_model}, \
vocabulary of {config.vocab_size}, {tokenizer.type_name} tokenizer), trained with srupp
(SRU++ recurrent layers for PyTorch) and written by `srupp export --format hf`.

The folder holds no code: the classes are srupp's. Install srupp
(`pip install 'srupp[hf]'`) and import `srupp.hf` before loading: that import
registers model type `srupp` with transformers' Auto classes, so no
`trust_remote_code` is needed.

```python
import srupp.hf  # noqa: F401  (registers model type "srupp")
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = "path/to/this/folder"
model = AutoModelForCausalLM.from_pretrained(folder)
tokenizer = AutoTokenizer.from_pretrained(folder)
batch = tokenizer(["A first prompt", "Another"], padding=True, return_tensors="pt")
out = model.generate(**batch, max_new_tokens=50, do_sample=False)
print(tokenizer.batch_decode(out))
```

The tokenizer gives exactly srupp's ids and adds no special tokens to a prompt.
It pads on the left with id 0 (`<unk>`, or the NUL byte of a byte tokenizer),
which the attention mask hides from the model. `generate()`'s cache is the model's own
decoding state: it reads the prompt once, then takes one step per new token.
"""


def _check_out_dir(out_dir: Path, ckpt: Path) -> None:
    """Refuse to replace anything but nothing, an empty folder or an earlier export."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file; give a folder to write the export to")
    if not any(out_dir.iterdir()):
        return
    try:
        earlier = json.loads((out_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        earlier = None
    if earlier != MODEL_TYPE or out_dir.resolve() in (ckpt.resolve(), ckpt.parent.resolve()):
        raise UserError(f"{out_dir} is not empty and holds no earlier Hugging Face export "
                         f"of a srupp model; give a new or empty folder")
