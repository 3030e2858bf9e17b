"""srupp.inference's translation path on characters its tokenizer never saw in training.

A translation model that copies its source stands in for a trained one: whatever
the text, what comes out of translate_lines is what its tokens decode to.
"""

import pytest
import torch
from torch import nn

from srupp.data import build_tokenizer
from srupp.inference import translate_lines
from srupp.models import EncoderDecoder, EncoderOutput

pytest.importorskip("sentencepiece", reason="needs sentencepiece: pip install 'srupp[subword]'")

# ASCII only: not one character of UNSEEN is in it
TRAIN = "\n".join(f"the {a} {b} sat on the {c}" for a in ("cat", "dog", "fox")
                  for b in ("quickly", "slowly") for c in ("mat", "hat", "rug")) + "\n"
UNSEEN = "¡Qué â ß 你好!"


class CopyModel(EncoderDecoder):
    """Outputs its source's tokens, in order (the source ends with <eos>, and so does
    the output). The decoder state is (position, source ids) per row."""

    def __init__(self, vocab_size, eos_id):
        nn.Module.__init__(self)
        self.config = type("Config", (), {"bos_id": eos_id, "eos_id": eos_id})()
        self.vocab_size, self.eos_id = vocab_size, eos_id

    @property
    def device(self):
        return torch.device("cpu")

    def encode(self, src, src_pad=None):
        return EncoderOutput(src.masked_fill(src_pad, self.eos_id), src_pad)

    def init_decoder(self, enc):
        position = torch.zeros(enc.states.shape[0], 1, dtype=torch.long)
        return torch.cat([position, enc.states], 1)             # (B, 1 + S)

    def reorder(self, state, index):
        return state.index_select(0, index)

    def step(self, tokens, state):
        position, source = state[:, 0], state[:, 1:]
        nxt = source.gather(1, position.clamp(max=source.shape[1] - 1).unsqueeze(1)).squeeze(1)
        # certain of it: another token (an early EOS) would end a beam's search sooner
        logp = torch.full((state.shape[0], self.vocab_size), float("-inf"))
        logp[torch.arange(state.shape[0]), nxt] = 0.0
        state = torch.cat([(position + 1).unsqueeze(1), source], 1)
        return logp, state


@pytest.mark.parametrize("beam", [1, 2])
def test_translations_of_characters_never_seen_in_training_have_no_unknown_piece(beam):
    tok = build_tokenizer("sentencepiece", TRAIN, vocab_size=280, model_type="bpe")
    assert tok.byte_fallback
    model = CopyModel(tok.vocab_size, tok.eos_id)
    lines = [UNSEEN, "", "the cat sat ¡on the mat!"]
    out = translate_lines(model, tok, lines, beam=beam, max_len_a=4.0)
    assert out == lines
    assert not any("⁇" in line for line in out)
    # without byte fallback (tokenizers saved before srupp had it), the same text has ⁇
    old = build_tokenizer("sentencepiece", TRAIN, vocab_size=30, model_type="bpe",
                          byte_fallback=False)
    old_out = translate_lines(CopyModel(old.vocab_size, old.eos_id), old, [UNSEEN], beam=beam)
    assert "⁇" in old_out[0]
