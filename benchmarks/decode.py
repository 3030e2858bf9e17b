"""Decoding speed of SRU++, SRU, LSTM and a KV-cached Transformer at one parameter count.

Every model is sized with ``srupp compare``'s rule (``size_model``) to --params
parameters from the recipe's base config, byte vocabulary (256), randomly
initialised (seeded), in eval mode under no_grad. The Transformer uses
sinusoidal positions and decodes with an unbounded KV cache (its
``generation_state`` with mem_len None); SRU++ keeps the recipe's attention
window (model.mem_len, by default train.unroll). Each dtype of --dtypes runs
every section; bf16 (``model.to(torch.bfloat16)``) only on a CPU with native
bf16, else it is recorded as skipped; int8 is ``model.quantize("int8")`` (int8
weights, one scale per output channel), computing in bf16 on a CPU with native
bf16, else in fp32, as ``srupp generate --dtype int8`` does; w8a8 is
``model.quantize("w8a8")`` (int8 activations too, per row; VNNI where the CPU has
it; the JSON names the kernel). With --recipe-model
SRU++ is the recipe's own model (e.g. ``recipes/enwik8-base.toml``, 108M
parameters, random weights) and the other models are sized to its count.

What is timed is the decode path only: after an untimed prefill, a loop of
``logits, state = model.step(tok, state); tok = logits.argmax(-1)`` (greedy;
what ``generate(..., temperature=0)`` runs per token, and the batch-1 section
checks that both give the same tokens). Models alternate within each round;
figures are medians over --rounds.

    batch1   batch 1, a 16-token prompt, --new tokens
    context  batch 1 after prefilling C tokens (chunks of 512 through forward with
             the state carried), --context-steps tokens; the state's resident bytes
             (distinct storages, spare room of growing buffers included) and
             logical bytes (sum of the tensors' nbytes), measured after decoding
    batched  B prompts of 16 tokens, --batched-new tokens; tokens/s = B * new / s

The bound: decoding one token reads every weight once (the input embedding
table: one row; int8 layers: their int8 weights, scales and biases). Its
bytes, copied with ``dst.copy_(src)`` (a buffer of that size, and one of
200 MB), give bytes/s = N / t and bound tokens/s = that / weight bytes; each
model's batch-1 speed is reported as a fraction of both.

SRU++ decodes each layer's step as one C++ op (``srupp::layer_step``); with
--modules it is also timed as ``srupp-modules``, the same model stepping
module by module (the step backend "modules"), side by side. ``srupp_generate``
times SRU++'s ``generate`` itself at batch 1, prefill excluded, through its C++
token loop (sampling, embedding, stack and output in one call per 64 tokens)
and through the Python loop (one ``model.step`` per token), side by side.

Prints one JSON object. Run it with nothing else on the machine:

    .venv/bin/python benchmarks/decode.py > docs/decode.json
    .venv/bin/python benchmarks/decode.py --quick      # tiny everything, a sanity run
    .venv/bin/python benchmarks/decode.py --recipe recipes/enwik8-base.toml --recipe-model \
        --models srupp --dtypes fp32,bf16,int8 --contexts 256 --batches 1 --new 32 \
        --rounds 3 --context-steps 8 --batched-new 8        # paper size: bytes, not calls
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shlex
import statistics
import sys
import time

import torch
from torch import nn

from _common import median_seconds
from srupp.models import build_model
from srupp.models.state import TensorState
from srupp.nn.quant import Int8Linear
from srupp.nn.state import SRUppState
from srupp.ops.layer_step import use_step_backend
from srupp.ops.quant import w8a8_vnni
from srupp.ops.settings import cpu_has_native_bf16
from srupp.train.compare import MODELS, size_model
from srupp.train.config import build_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16,  # int8, w8a8: see as_dtype
          "int8": None, "w8a8": None}
PROMPT, CHUNK, VOCAB = 16, 512, 256


def int_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="srupp,sru,lstm,transformer",
                    help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--params", type=int, default=5_000_000)
    ap.add_argument("--recipe", default="recipes/shakespeare-cpu.toml")
    ap.add_argument("--recipe-model", action="store_true",
                    help="SRU++ is the recipe's model as it is (--params: its count)")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides, key=value")
    ap.add_argument("--dtypes", default="fp32,bf16", help="from fp32, bf16, int8, w8a8")
    ap.add_argument("--new", type=int, default=256, help="batch1: tokens decoded")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--contexts", type=int_list, default=[256, 1024, 4096, 16384])
    ap.add_argument("--context-steps", type=int, default=64)
    ap.add_argument("--batches", type=int_list, default=[1, 8, 64])
    ap.add_argument("--batched-new", type=int, default=64)
    ap.add_argument("--copy-mb", type=float, default=200.0, help="the large copy buffer")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--modules", action="store_true",
                    help="also time SRU++ stepping module by module (srupp-modules)")
    ap.add_argument("--quick", action="store_true", help="tiny everything, for a sanity check")
    a = ap.parse_args()
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    for m in a.models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for d in a.dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    if not a.models or not a.dtypes or len(set(a.models)) < len(a.models):
        ap.error("--models and --dtypes need at least one name, each named once")
    if a.quick:  # the SRU++ window (train.unroll) is cut to 16, below both contexts
        a.params, a.contexts, a.new, a.rounds, a.batches = 200_000, [32, 64], 8, 1, [1, 2]
        a.context_steps, a.batched_new, a.copy_mb = 8, 8, 4.0
        a.set = ["train.unroll=16", *a.set]
    return a


def copy_bytes_per_s(nbytes: int) -> float:
    """Bytes of the buffer per second (N / t) of ``dst.copy_(src)``, median of repeats."""
    src = torch.ones(max(int(nbytes), 1), dtype=torch.uint8)
    dst = torch.empty_like(src)
    repeats = max(10, min(200, int(2e9 / src.numel())))
    return src.numel() / median_seconds(lambda: dst.copy_(src), repeats, warmup=2)


def weight_bytes(model) -> int:
    """Bytes read per token: every parameter and int8 layer's buffers, but one row of an
    untied input embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for m in model.modules()
                 if isinstance(m, Int8Linear) for b in m.buffers())
    emb = model.embedding
    if isinstance(emb, nn.Embedding) and emb.weight is not getattr(model.output, "weight", None):
        w = emb.weight
        total -= (w.shape[0] - 1) * w.shape[1] * w.element_size()
    return total


def state_tensors(state):
    if isinstance(state, SRUppState):
        ts = [state.c, state.memory_mask_pad, *state.memory,
              *(kv.kv for kv in state.kv_cache if kv is not None)]
    elif isinstance(state, TensorState):
        ts = list(state.tensors.values())
    else:
        raise TypeError(f"unknown state {type(state).__name__}")
    return [t for t in ts if t is not None]


def state_bytes(state):
    """(resident bytes of the distinct storages, logical bytes of the tensors)."""
    storages = {}
    for t in state_tensors(state):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values()), sum(t.nbytes for t in state_tensors(state))


def step_backend(name):
    """The step backend a model name runs under: "modules" for srupp-modules."""
    return use_step_backend("modules") if name.endswith("-modules") else contextlib.nullcontext()


def decode(model, tok, state, n):
    """The timed path: n greedy steps. Returns (tokens (B, n), state)."""
    out = []
    for _ in range(n):
        logits, state = model.step(tok, state)
        tok = logits.argmax(-1)
        out.append(tok)
    return torch.stack(out, 1), state


def prefill(model, tokens):
    """Feed tokens (B, L) in chunks through forward; returns (next token (B,), state)."""
    state = model.generation_state(tokens.shape[0])
    for i in range(0, tokens.shape[1], CHUNK):
        out = model(tokens[:, i:i + CHUNK], state)
        state = out.state
    return out.logits[:, -1].argmax(-1), state


def timed_rate(model, prompts, n):
    """Tokens/s of decoding n steps after an untimed prefill of prompts (B, L)."""
    tok, state = prefill(model, prompts)
    t0 = time.perf_counter()
    decode(model, tok, state, n)
    return prompts.shape[0] * n / (time.perf_counter() - t0)


@contextlib.contextmanager
def token_loop(model, cpp):
    """``model.generate`` through its C++ token loop (``cpp``) or the Python one."""
    from srupp.ops.settings import tuning

    with tuning().use(decode_chunk=tuning().decode_chunk if cpp else 0):
        yield


def generate_rate(model, prompt, n, cpp):
    """Tokens/s of greedy ``model.generate`` past its prefill: the n - 1 tokens a call for n
    adds to a call for 1. ``cpp``: through the C++ token loop, else the Python one."""
    p = prompt.tolist()
    with token_loop(model, cpp):
        t0 = time.perf_counter()
        model.generate(p, 1, temperature=0)
        t1 = time.perf_counter()
        model.generate(p, n, temperature=0)
        t2 = time.perf_counter()
    return (n - 1) / max((t2 - t1) - (t1 - t0), 1e-9)


def generate_loops(a, model, prompt, bound):
    """SRU++'s ``generate`` at batch 1 through the C++ token loop and the Python one."""
    got = {}
    for cpp in (True, False):  # warm-up, and the check that both give the same tokens
        with token_loop(model, cpp):
            got[cpp] = model.generate(prompt.tolist(), a.new, temperature=0)
    speeds = {True: [], False: []}
    for _ in range(a.rounds):
        for cpp in speeds:
            speeds[cpp].append(generate_rate(model, prompt, a.new, cpp))
    cpp, py = (round(statistics.median(speeds[k]), 1) for k in (True, False))
    return {"cpp_loop_tokens_per_s": cpp, "python_loop_tokens_per_s": py,
            "cpp_over_python": ratio(cpp, py), "same_tokens": got[True] == got[False],
            "cpp_loop_fraction_of_bound_weight_buffer": ratio(
                cpp, bound["bound_tokens_per_s_weight_buffer"]),
            "cpp_loop_fraction_of_bound_large_buffer": ratio(
                cpp, bound["bound_tokens_per_s_large_buffer"]),
            "cpp_loop_us_per_token": round(1e6 / cpp, 1),
            "parts_us": token_parts(model, prompt)}


def token_parts(model, prompt, reps=500):
    """Microseconds of the parts of a C++ loop token, each replayed alone (median of 5 ×
    reps calls) after the prompt and 16 steps: the stack's kernel (``stack_step``, its
    arguments fixed), the output layer and the embedding (their modules, so a few µs of
    Python more than the loop's C++ calls), the argmax."""
    from srupp.ops.layer_step import stack_step_arguments, stack_step_kernel

    out = model(prompt)
    state, tok = out.state, out.logits[:, -1].argmax(-1)
    for _ in range(16):
        logits, state = model.step(tok, state)
        tok = logits.argmax(-1)
    x = model.embedding(tok)                                                 # (1, d)
    plan = model.backbone.decode_plan(state, 1, x)
    if plan is None:
        return None
    kernel = stack_step_kernel()
    args = stack_step_arguments(x, plan.stack_args(), first=0, kept=plan.M + 1)  # row M again
    h = kernel(*args)[0]                                                     # (1, D)
    parts = {"stack_kernel": lambda: kernel(*args),
             "output_module": lambda: model.output(h),
             "argmax": lambda: logits.argmax(-1),
             "embedding_module": lambda: model.embedding(tok)}
    return {name: round(1e6 * median_seconds(lambda: [f() for _ in range(reps)], 5) / reps, 1)
            for name, f in parts.items()}


def tokens(B, L, seed):
    return torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


def ratio(a, b):
    return round(a / b, 3) if b else None


def run_dtype(a, models, copy_large):
    """Every section for the models (already in this dtype)."""
    names = list(models)
    res = {"bounds": {}, "batch1": {}, "context": {}, "batched": {}}
    for n, m in models.items():
        wb = weight_bytes(m)
        bw = copy_bytes_per_s(wb)
        res["bounds"][n] = {"weight_bytes": wb, "copy_GBps_weight_buffer": round(bw / 1e9, 2),
                            "bound_tokens_per_s_weight_buffer": round(bw / wb, 1),
                            "bound_tokens_per_s_large_buffer": round(copy_large / wb, 1)}

    prompt = tokens(1, PROMPT, 1)
    speeds = {n: [] for n in names}
    for n, m in models.items():  # warm-up, and the check that the loop is generate's
        with step_backend(n):
            gen = m.generate(prompt.tolist(), a.new, temperature=0)[0]
            tok, state = prefill(m, prompt)
            loop = [int(tok)] + decode(m, tok, state, a.new - 1)[0][0].tolist()
        res["batch1"][n] = {"same_tokens_as_generate": loop == gen}
    for _ in range(a.rounds):
        for n, m in models.items():
            with step_backend(n):
                speeds[n].append(timed_rate(m, prompt, a.new))
    for n in names:
        rate, b = round(statistics.median(speeds[n]), 1), res["bounds"][n]
        res["batch1"][n].update(
            tokens_per_s=rate,
            fraction_of_bound_weight_buffer=ratio(rate, b["bound_tokens_per_s_weight_buffer"]),
            fraction_of_bound_large_buffer=ratio(rate, b["bound_tokens_per_s_large_buffer"]))

    if "srupp-modules" in names:
        res["batch1"]["srupp_fused_over_modules"] = ratio(
            res["batch1"]["srupp"]["tokens_per_s"], res["batch1"]["srupp-modules"]["tokens_per_s"])
    if "srupp" in names:
        res["batch1"]["srupp_generate"] = generate_loops(a, models["srupp"], prompt,
                                                         res["bounds"]["srupp"])

    ctx = {k: {n: {} for n in names} for k in ("tokens_per_s", "state_bytes",
                                                "state_logical_bytes")}
    for C in a.contexts:
        states = {}
        for n, m in models.items():
            with step_backend(n):
                tok, state = prefill(m, tokens(1, C, 2))
                states[n] = decode(m, tok, state, 2)  # warm-up steps
        speeds = {n: [] for n in names}
        for _ in range(a.rounds):
            for n, m in models.items():
                last, state = states[n]
                with step_backend(n):
                    t0 = time.perf_counter()
                    states[n] = decode(m, last[:, -1], state, a.context_steps)
                    speeds[n].append(a.context_steps / (time.perf_counter() - t0))
        for n in names:
            resident, logical = state_bytes(states[n][1])
            ctx["tokens_per_s"][n][str(C)] = round(statistics.median(speeds[n]), 1)
            ctx["state_bytes"][n][str(C)] = resident
            ctx["state_logical_bytes"][n][str(C)] = logical
        del states
    if "srupp" in names and "transformer" in names:
        s, t = (ctx["tokens_per_s"][k] for k in ("srupp", "transformer"))
        sb, tb = (ctx["state_bytes"][k] for k in ("srupp", "transformer"))
        ctx["ratios"] = {
            "srupp_over_transformer_tokens_per_s": {C: ratio(s[C], t[C]) for C in s},
            "srupp_over_transformer_state_bytes": {C: ratio(sb[C], tb[C]) for C in sb}}
    for n in names:
        r = ctx["tokens_per_s"][n]
        lo, hi = str(min(a.contexts)), str(max(a.contexts))
        ctx.setdefault("largest_over_smallest_context_tokens_per_s", {})[n] = ratio(r[hi], r[lo])
    res["context"] = ctx

    for B in a.batches:
        prompts = tokens(B, PROMPT, 3)
        speeds = {n: [] for n in names}
        for n, m in models.items():
            with step_backend(n):
                timed_rate(m, prompts, 2)  # warm-up at this batch size
        for _ in range(a.rounds):
            for n, m in models.items():
                with step_backend(n):
                    speeds[n].append(timed_rate(m, prompts, a.batched_new))
        for n in names:
            res["batched"].setdefault(n, {})[str(B)] = round(statistics.median(speeds[n]), 1)
    if "srupp-modules" in names:
        b = res["batched"]
        b["srupp_fused_over_modules"] = {B: ratio(b["srupp"][B], b["srupp-modules"][B])
                                         for B in b["srupp"]}
    return res


def int8_activations() -> str:
    """What int8 layers compute in: bf16 where the CPU has it natively (as srupp generate)."""
    return "bf16" if cpu_has_native_bf16() else "fp32"


def as_dtype(model, d):
    """A copy of ``model`` with the weights of dtype name ``d``."""
    model = copy.deepcopy(model)
    if d in ("int8", "w8a8"):
        model.quantize(d)
        d = int8_activations()
    return model.to(DTYPES[d])


def main():
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    base = build_config(a.recipe, a.set)
    result = {"command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu_has_native_bf16": cpu_has_native_bf16(),
              "loadavg_before": [round(v, 2) for v in load_before],
              "settings": {"recipe": a.recipe, "set": a.set, "params_target": a.params,
                           "vocab": VOCAB, "prompt_tokens": PROMPT, "prefill_chunk": CHUNK,
                           "new": a.new, "rounds": a.rounds, "contexts": a.contexts,
                           "context_steps": a.context_steps, "batches": a.batches,
                           "batched_new": a.batched_new},
              "models": {}}
    built = {}
    if a.recipe_model:  # the recipe's SRU++ sets the count the others are sized to
        a.params = build_model(base.model_config(VOCAB)).num_parameters()
        result["settings"]["params_target"] = a.params
    for n in a.models:
        extra = ["model.positions=sinusoidal"] if MODELS[n][0] == "transformer" else []
        if a.recipe_model and n == "srupp":
            mc = base.model_config(VOCAB)
        else:
            mc = size_model(n, base, VOCAB, a.params, overrides=extra).cfg.model_config(VOCAB)
        torch.manual_seed(0)
        built[n] = build_model(mc).eval()
        window = getattr(mc, "mem_len", None) if mc.type == "srupp" else None
        result["models"][n] = {"type": mc.type, "params": built[n].num_parameters(),
                               "d_model": mc.d_model,
                               "num_layers": mc.num_layers,
                               "proj_size": getattr(mc, "proj_size", None),
                               "attention_window": window}
    if a.modules and "srupp" in built:
        built["srupp-modules"] = built["srupp"]
        result["models"]["srupp-modules"] = dict(result["models"]["srupp"], step="modules")
    copy_large = copy_bytes_per_s(a.copy_mb * 1e6)
    result["copy_large_buffer"] = {"bytes": int(a.copy_mb * 1e6),
                                   "GBps": round(copy_large / 1e9, 2)}
    result["dtypes"] = {}
    with torch.no_grad():
        for d in a.dtypes:
            if d == "bf16" and not cpu_has_native_bf16():
                result["dtypes"][d] = {"skipped": "this CPU has no native bf16 (AVX-512 BF16 "
                                                  "or AMX): bf16 would be emulated"}
                continue
            models = {n: as_dtype(m, d) for n, m in built.items()}
            result["dtypes"][d] = run_dtype(a, models, copy_large)
            if d in ("int8", "w8a8"):
                result["dtypes"][d]["activations"] = int8_activations()
            if d == "w8a8":
                result["dtypes"][d]["kernel"] = "vnni" if w8a8_vnni() else "plain"
    result["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
