"""Generate text from an exported srupp language model with onnxruntime and numpy alone.

    srupp export --checkpoint runs/shakespeare --format onnx --out exported/
    python examples/onnx_generate.py exported/ --prompt "ROMEO." --temperature 0

The folder holds what `srupp export --format onnx` writes: forward.onnx (the
prompt in one pass), step.onnx (one token), srupp-onnx.json (the state's names)
and tokenizer.json. With --temperature 0 (greedy) the text is the same as
`srupp generate --temperature 0` on the run. Sampling (a temperature above 0,
optionally --top-k) uses numpy's random numbers, so its text differs from
srupp generate's, which draws with torch.

Byte and char tokenizers are decoded here; a run with another tokenizer
(word, sentencepiece) is refused with a message.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


# --------------------------------------------------------------------------- tokenizers
# The same mappings as srupp.data.tokenizers, without torch.

class ByteCodec:
    """UTF-8 bytes as ids 0..255."""

    def __init__(self, saved: dict):
        pass

    def encode(self, text: str) -> list:
        # "surrogateescape", as srupp's byte tokenizer: U+DC80..U+DCFF stand for raw bytes
        return list(text.encode("utf-8", errors="surrogateescape"))

    def decode(self, ids: list) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class CharCodec:
    """Characters as ids: 0 is <unk> (decoded as U+FFFD), then the run's sorted characters."""

    def __init__(self, saved: dict):
        self.chars = "\ufffd" + saved["chars"]
        self.ids = {ch: i for i, ch in enumerate(saved["chars"], start=1)}

    def encode(self, text: str) -> list:
        return [self.ids.get(ch, 0) for ch in text]

    def decode(self, ids: list) -> str:
        return "".join(self.chars[i] for i in ids)


CODECS = {"byte": ByteCodec, "char": CharCodec}


def load_codec(folder: Path, description: dict):
    if not description.get("tokenizer"):
        sys.exit(f"{folder} holds no tokenizer.json; export the run with srupp export")
    saved = json.loads((folder / description["tokenizer"]).read_text())
    kind = saved.get("type")
    if kind not in CODECS:
        sys.exit(f"this example decodes byte and char tokenizers; the run's is {kind!r}")
    return CODECS[kind](saved)


# --------------------------------------------------------------------------- sampling

def pick(logits: np.ndarray, temperature: float, top_k, rng: np.random.Generator) -> int:
    """One token from logits (V,): the most likely one at temperature 0, else a sample."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < z.size:
        kth = np.sort(z)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


class Streamer:
    """Prints the text of growing ids, holding back a character that may be incomplete."""

    def __init__(self, codec):
        self.codec, self.ids, self.printed = codec, [], ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return  # maybe the first bytes of a multi-byte character
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text

    def finish(self) -> None:
        text = self.codec.decode(self.ids)
        sys.stdout.write(text[len(self.printed):] if text.startswith(self.printed) else "")
        sys.stdout.write("\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------- generation

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path, help="what srupp export --format onnx wrote")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0: its choice)")
    args = p.parse_args(argv)

    folder = args.folder
    description = json.loads((folder / "srupp-onnx.json").read_text())
    codec = load_codec(folder, description)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = {name: ort.InferenceSession(str(folder / file), options,
                                          providers=["CPUExecutionProvider"])
               for name, file in description["graphs"].items()}
    state_names = description["state"]  # what step.onnx takes, and returns as new_<name>

    prompt = codec.encode(args.prompt)
    if not prompt:
        sys.exit("--prompt is empty: give at least one character")
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    rng = np.random.default_rng(args.seed)
    stream = Streamer(codec)
    start = time.perf_counter()

    # the prompt in one pass: its last logits, and the state to continue from
    out_names = [o.name for o in session["forward"].get_outputs()]
    outs = dict(zip(out_names, session["forward"].run(
        None, {"tokens": np.array([prompt], dtype=np.int64)})))
    logits = outs["logits"][0, -1]
    state = {name: outs[f"new_{name}"] for name in state_names}

    step_names = [o.name for o in session["step"].get_outputs()]
    for _ in range(args.max_new_tokens):
        token = pick(logits, args.temperature, args.top_k, rng)
        stream.add(token)
        feeds = {"tokens": np.array([token], dtype=np.int64), **state}
        outs = dict(zip(step_names, session["step"].run(None, feeds)))
        logits = outs["logits"][0]
        state = {name: outs[f"new_{name}"] for name in state_names}
    seconds = time.perf_counter() - start
    stream.finish()
    print(json.dumps({"prompt_tokens": len(prompt), "new_tokens": len(stream.ids),
                      "seconds": round(seconds, 3),
                      "tokens_per_s": round(len(stream.ids) / max(seconds, 1e-9), 1)}),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
