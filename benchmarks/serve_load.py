"""Load on `srupp serve`: concurrent SSE streams, against the compute bound, beside a Transformer.

It starts the server itself (``python -m srupp serve``, one process per model), runs
1, 8, 32 and 128 concurrent streaming requests with a fixed prompt and length
(asyncio + httpx), and reports per level:

- aggregate tokens/s while every stream decodes (tokens whose arrival falls between
  the last stream's first token and the first stream's last; None when that window
  holds under a quarter of the tokens), and over the whole run (prompts read and all);
- that rate's share of the compute bound: 2 FLOPs per weight per token (the weights
  of every product: the embedding table is a lookup and is not counted) at the bf16
  GEMM peak measured in this process before the servers start;
- time to first token and inter-token latency, p50 and p99, from the client (an event
  of several tokens, a chunk of the C++ token loop, counts as that many gaps of its
  gap over its tokens: ``inter_token``), and the gap between events with the mean
  tokens per event;
- the server's RSS growth per stream (peak RSS during the level minus RSS idle before
  it, over the stream count), beside the state bytes the server reports per stream;
- in this process, without HTTP (``in_process``): the bare batched step and the engine
  alone at each level, with their shares of the bound: where the server's time goes.

Models: the 5M ``shakespeare-cpu`` SRU++ (the recipe's shape, random weights: speed
does not depend on the values) and the project's Transformer at about the same size
with its KV cache, both with an output bias that keeps generation to ASCII (so that
every token is one character, which the client counts). Each stream
reads ``--prompt`` tokens and generates ``--tokens`` (2,048: long enough that the rate
while every stream decodes is timed over most of the tokens, not a few chunks between
the staggered arrivals and the first stream's end); ``--contexts`` adds runs
where the prompt and ``--context-tokens`` generated fill the context (256 and 2,048
tokens) for both models, compared by their rates over the whole run.

    .venv/bin/python benchmarks/serve_load.py [--levels 1,8,32,128] [--tokens 2048]
        [--contexts 256,2048] [--context-tokens 128] [--dtype bf16]
        [--out docs/serve_load.json] [--tiny]

Run it with nothing else on the machine. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _common import bf16_gemm_peak, cpu_name

ROOT = Path(__file__).resolve().parents[1]
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east. "


def make_checkpoint(kind: str, folder: Path, tiny: bool = False) -> dict:
    """A byte-level checkpoint of the shakespeare-cpu SRU++ or a Transformer of its size,
    random weights, generation kept to ASCII; returns its sizes. ``tiny``: small ones, for
    the smoke test."""
    from srupp.models import build_model
    from srupp.models.config import config_class

    torch.manual_seed(0)
    k = 8 if tiny else 1
    if kind == "srupp":
        cfg = config_class("lm", "srupp")(vocab_size=256, d_model=1024 // k, proj_size=256 // k,
                                          num_layers=4, num_heads=1, dropout=0.0,
                                          tie_embeddings=False, mem_len=128 // k)
    else:  # 6 blocks of 256: 12·d² each, about the SRU++'s 4.7M in its layers
        cfg = config_class("lm", "transformer")(vocab_size=256, d_model=256 // k, num_layers=6,
                                                num_heads=4, dropout=0.0, tie_embeddings=False)
    model = build_model(cfg)
    with torch.no_grad():
        model.output.bias[128:] = -1e4  # ASCII only: one character per token
        model.output.bias[:32] = -1e4   # and printable
        model.output.bias[10] = 0.0
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps({"type": "byte"}))
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embedding"))
    return {"params": sum(p.numel() for p in model.parameters()), "product_weights": weights}


class ServerProcess:
    def __init__(self, ckpt: Path, *, dtype: str, max_streams: int, mem_len=None,
                 chunk_ms=None):
        cmd = [sys.executable, "-m", "srupp", "serve", "--checkpoint", str(ckpt), "--port", "0",
               "--dtype", dtype, "--max-streams", str(max_streams), "--max-queue", "1024"]
        if mem_len is not None:
            cmd += ["--mem-len", str(mem_len)]
        if chunk_ms is not None:
            cmd += ["--chunk-ms", str(chunk_ms)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        self.info = json.loads(self.proc.stdout.readline())
        self.url = self.info["url"]
        import httpx

        for _ in range(600):  # up once /health answers 200
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)

    def rss(self) -> int:
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


async def one_stream(client, url: str, prompt: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    arrivals, events = [], []
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0]["text"]
            now = time.perf_counter()
            arrivals += [now] * len(text)  # ASCII: one character per token
            if text:
                events.append((now, len(text)))
    return {"start": t0, "arrivals": arrivals, "events": events}


def inter_token(events) -> list:
    """Inter-token latencies of one stream from its events (arrival time, tokens): an
    event of n tokens that came g seconds after the one before gives n gaps of g / n (a
    chunk's tokens spread over the time it took, as the server's own histogram counts
    them). The first event's tokens are the time to first token's, not gaps."""
    return [(b - a) / n for (a, _), (b, n) in zip(events, events[1:]) for _ in range(n)]


async def level(url: str, n: int, prompt: str, tokens: int, server: ServerProcess) -> dict:
    import httpx

    peak = [server.rss()]
    idle = peak[0]
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(0.05):
            peak[0] = max(peak[0], server.rss())

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[one_stream(client, url, prompt, tokens) for _ in range(n)])
        wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    arrivals = [r["arrivals"] for r in runs]
    total = sum(len(a) for a in arrivals)
    all_decoding = max(a[0] for a in arrivals)
    first_done = min(a[-1] for a in arrivals)
    inside = sum(1 for a in arrivals for t in a if all_decoding < t <= first_done)
    span = first_done - all_decoding
    ttft = [r["arrivals"][0] - r["start"] for r in runs]
    itl = [g for r in runs for g in inter_token(r["events"])]
    gaps = [b - a for r in runs for (a, _), (b, _) in zip(r["events"], r["events"][1:])]
    per_event = sum(n for r in runs for _, n in r["events"]) / max(1, sum(len(r["events"])
                                                                        for r in runs))

    def ms(xs, q, digits):  # the q-quantile in ms; None without any (one event per stream)
        xs = sorted(xs)
        return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], digits) if xs else None

    return {"streams": n, "tokens": total, "wall_s": round(wall, 3),
            # (None when that window holds under a quarter of the tokens: too short to time)
            "tokens_per_s_all_decoding": round(inside / span, 1)
            if span > 0 and 4 * inside >= total else None,
            "tokens_per_s_overall": round(total / wall, 1),
            "ttft_ms": {"p50": ms(ttft, 0.5, 2), "p99": ms(ttft, 0.99, 2)},
            "itl_ms": {"p50": ms(itl, 0.5, 3), "p99": ms(itl, 0.99, 3)},
            "event_gap_ms": {"p50": ms(gaps, 0.5, 3), "p99": ms(gaps, 0.99, 3)},
            "tokens_per_event": round(per_event, 2),
            "rss_growth_per_stream_bytes": round((peak[0] - idle) / n)}


def in_process(ckpt: Path, dtype: str, levels, prompt_len: int, tokens: int) -> list:
    """Per level, without HTTP: the bare batched step (``model.step`` on that many rows, as
    the engine runs it) and the engine alone (streams submitted and stepped in this
    process): where the server's time goes."""
    from srupp.inference import load_run, weights_for_decoding
    from srupp.ops.matmul import batch_invariant

    run = load_run(ckpt)
    model, tok = run.model, run.tokenizer
    weights_for_decoding(model, dtype)
    prompt = tok.encode((TEXT * (prompt_len // len(TEXT) + 1))[:prompt_len]).tolist()
    out = []
    for n in levels:
        with torch.no_grad(), batch_invariant(n):
            state = model.backbone.padded_state(n, model.config.mem_len or 128)
            _, state = model.prefill(torch.tensor([prompt] * n), state)
            ids = torch.zeros(n, dtype=torch.long)
            for _ in range(3):
                _, state = model.step(ids, state)
            reps, t = 20, time.perf_counter()
            for _ in range(reps):
                logits, state = model.step(ids, state)
            step_s = (time.perf_counter() - t) / reps
            loop_s = token_loop_seconds(model, state, logits)
        rate = max(engine_rate(model, tok, prompt, n, tokens, max(levels)) for _ in range(2))
        out.append({"streams": n, "bare_step_ms": round(1e3 * step_s, 3),
                    "bare_step_tokens_per_s": round(n / step_s, 1),
                    "token_loop_tokens_per_s": round(n / loop_s, 1) if loop_s else None,
                    "engine_tokens_per_s": round(rate, 1)})
    return out


def engine_rate(model, tok, prompt, n: int, tokens: int, max_streams: int) -> float:
    """tokens/s of an engine in this process while n streams all decode (the better of
    the calls decides: one run of a few hundred milliseconds can meet a pause)."""
    from srupp.engine import Engine, Sampling

    engine = Engine(model, tok, max_streams=max_streams)
    streams = [engine.submit(prompt, Sampling(max_tokens=tokens, temperature=0))
               for _ in range(n)]
    while not all(s.generated for s in streams):  # every stream decoding
        engine.step()
    done0, t = sum(len(s.generated) for s in streams), time.perf_counter()
    while not all(s.done for s in streams):
        engine.step()
    return (sum(len(s.generated) for s in streams) - done0) / (time.perf_counter() - t)


def token_loop_seconds(model, state, logits, tokens: int = 32):
    """Seconds per token of the C++ token loop on the state's rows (greedy, ``tokens``
    fed in one call): what the engine's chunks run. None where the loop can't run."""
    emb = model.embedding
    rows = logits.shape[0]
    decoder = model.fused_decoder(state, tokens + 1, emb.weight.new_empty(rows, emb.embedding_dim))
    if decoder is None:
        return None
    steps, output = decoder
    t = time.perf_counter()
    steps.decode(logits, torch.zeros(rows, dtype=torch.bool), emb.weight, output, final=True,
                 temperature=0, top_k=None, top_p=None, generator=None, eos_id=None)
    return (time.perf_counter() - t) / tokens


def share_of_bound(tokens_per_s: float, sizes: dict, peak_gflops: float) -> float:
    """tokens/s over the compute bound: 2 FLOPs per product weight per token at the peak
    (three significant digits: a tiny model's share is small)."""
    return float(f"{tokens_per_s * 2 * sizes['product_weights'] / (peak_gflops * 1e9):.3g}")


def run_model(kind: str, ckpt: Path, sizes: dict, args, peak_gflops: float, levels, prompt_len,
              tokens=None, mem_len=None) -> dict:
    server = ServerProcess(ckpt, dtype=args.dtype, max_streams=max(levels), mem_len=mem_len,
                           chunk_ms=args.chunk_ms)
    try:
        prompt = (TEXT * (prompt_len // len(TEXT) + 1))[:prompt_len]
        asyncio.run(level(server.url, 1, prompt, 8, server))  # warm-up: kernels, allocator
        out = {"model": kind, **sizes, "state_bytes_per_stream": server.info["state_bytes_per_stream"],
               "window": server.info["window"], "prompt_tokens": prompt_len, "levels": []}
        for n in levels:
            r = asyncio.run(level(server.url, n, prompt, tokens or args.tokens, server))
            rate = r["tokens_per_s_all_decoding"] or r["tokens_per_s_overall"]
            r["share_of_compute_bound"] = share_of_bound(rate, sizes, peak_gflops)
            r["rss_over_state"] = round(r["rss_growth_per_stream_bytes"]
                                        / max(1, out["state_bytes_per_stream"]), 2)
            out["levels"].append(r)
            print(json.dumps({kind: r}), file=sys.stderr, flush=True)
        return out
    finally:
        server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,8,32,128")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens generated per stream")
    ap.add_argument("--context-tokens", type=int, default=128,
                    help="tokens generated per stream in the context comparison")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    ap.add_argument("--contexts", default="256,2048",
                    help="context lengths of the SRU++/Transformer comparison ('' to skip)")
    ap.add_argument("--context-streams", type=int, default=32)
    ap.add_argument("--dtype", default="bf16" if _native_bf16() else "fp32")
    ap.add_argument("--chunk-ms", type=float, default=None,
                    help="the server's --chunk-ms (default: the server's own)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--tiny", action="store_true", help="small models (the smoke test)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x]
    peak = bf16_gemm_peak(0.2 if args.tiny else 2.0)
    out = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "dtype": args.dtype, "chunk_ms": args.chunk_ms, "bf16_gemm_peak_gflops": round(peak, 1),
           "tokens_per_stream": args.tokens, "context_tokens_per_stream": args.context_tokens,
           "load": [], "contexts": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {}
        for kind in ("srupp", "transformer"):
            ckpts[kind] = (Path(tmp) / kind, make_checkpoint(kind, Path(tmp) / kind, args.tiny))
        ck, sizes = ckpts["srupp"]
        out["load"].append(run_model("srupp", ck, sizes, args, peak, levels, args.prompt))
        inside = in_process(ck, args.dtype, levels, args.prompt, args.tokens)
        for row in inside:
            for key in ("bare_step_tokens_per_s", "token_loop_tokens_per_s",
                        "engine_tokens_per_s"):
                row[key.replace("tokens_per_s", "share_of_compute_bound")] = None \
                    if row[key] is None else share_of_bound(row[key], sizes, peak)
        out["in_process"] = inside
        for ctx in [int(x) for x in args.contexts.split(",") if x]:
            row = {"context": ctx}
            for kind in ("srupp", "transformer"):
                ck, sizes = ckpts[kind]
                r = run_model(kind, ck, sizes, args, peak, [args.context_streams],
                              ctx - args.context_tokens, tokens=args.context_tokens,
                              mem_len=ctx if kind == "transformer" else None)
                row[kind] = r
            s, t = row["srupp"]["levels"][0], row["transformer"]["levels"][0]
            # the whole run: each model's prompts read and its tokens generated
            row["srupp_over_transformer_tokens_per_s"] = round(
                s["tokens_per_s_overall"] / t["tokens_per_s_overall"], 2)
            row["srupp_over_transformer_state_bytes"] = round(
                row["srupp"]["state_bytes_per_stream"]
                / row["transformer"]["state_bytes_per_stream"], 3)
            out["contexts"].append(row)
    load = out["load"][0]["levels"]
    by_n = {r["streams"]: r for r in load}
    if 1 in by_n and 32 in by_n:
        rate = lambda r: r["tokens_per_s_all_decoding"] or r["tokens_per_s_overall"]  # noqa: E731
        out["speedup_32_over_1"] = round(rate(by_n[32]) / rate(by_n[1]), 2)
        out["itl_p99_over_p50_at_32"] = round(by_n[32]["itl_ms"]["p99"] / by_n[32]["itl_ms"]["p50"], 2)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _native_bf16() -> bool:
    from srupp.ops.settings import cpu_has_native_bf16

    return cpu_has_native_bf16()


if __name__ == "__main__":
    main()
