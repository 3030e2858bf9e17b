"""The ``srupp`` command: train, eval, generate, translate, classify, export, params, compare,
demo.

Problems with the user's input print one line on stderr and exit with code 2:
a ``UserError`` (the library's ``ValueError``/``TypeError`` about a recipe,
``--set`` values, data or stdin become one where the input is read), an
argparse error, an ``OSError`` (with the file it concerns) and a missing
optional package (with the ``pip install`` line that adds it). ``--debug`` (or
``SRUPP_DEBUG=1``) prints their traceback too. Any other exception is a bug and
keeps its traceback. Ctrl-C and SIGTERM exit with code 130.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Iterator, List, Optional

from .errors import UserError, user_input


def cmd_train(args) -> int:
    from .train import Trainer, build_config, distributed
    from .runs import RUN_CONFIG, read_run_config

    distributed.die_with_launcher()  # under torchrun: never outlive the launcher

    out = Path(args.out) if args.out else Path("runs") / (Path(args.recipe).stem if args.recipe
                                                         else "default")
    overrides = list(args.set)
    if args.data:
        overrides.append(f"data.corpus={args.data}")
    base = None
    if args.resume:
        if not (out / RUN_CONFIG).exists():
            raise UserError(f"--resume: {out} holds no run to resume (no {RUN_CONFIG})")
        base = read_run_config(out)
    cfg = build_config(args.recipe, overrides, base=base, base_name=str(out))
    dist = distributed.setup(cfg.train.device, cfg.train.dist_backend, cfg.train.dist_timeout)
    try:
        trainer = Trainer(cfg, out, resume=args.resume, progress=not args.no_progress,
                          dist=dist)
        if trainer.finished_at is not None:  # its budget is spent: say so, write nothing
            distributed.teardown(dist)
            if dist.is_main:
                print(f"srupp: {trainer.finished_message}", file=sys.stderr)
            return 0
        if dist.is_main:
            ranks = f", {dist.world_size} processes" if dist.enabled else ""
            print(f"srupp: training {trainer.model.num_parameters():,} parameters into {out} "
                  f"({cfg.data.corpus}, {cfg.data.tokenizer} tokens, precision "
                  f"{trainer.precision}{ranks})", file=sys.stderr)
        summary = trainer.train()
        del trainer  # free the (sharded) model before the process group goes
    except RuntimeError as e:
        distributed.teardown(dist, wait_for_all=False)
        if not dist.enabled:
            raise
        # a collective failed: another rank stopped (its own error says why) or hung
        # past train.dist_timeout; no traceback on top of the one line that matters
        raise UserError(f"rank {dist.rank}: training stopped because another process did "
                        f"({_one_line(e)[:200]})") from None
    except BaseException:
        distributed.teardown(dist, wait_for_all=False)
        raise
    distributed.teardown(dist)
    if dist.is_main:
        print(json.dumps(summary))
    return 130 if summary["interrupted"] else 0


def _load_for(args, command: str):
    """load_run, refusing with one line a checkpoint of another task than ``command``'s."""
    from .inference import load_run
    from .train.registry import TASKS, task_of_command

    need = task_of_command(command)
    run = load_run(args.checkpoint)
    have = TASKS[run.model.config.task]
    if have is not need:
        raise UserError(f"srupp {command} needs a {need.title} checkpoint (task={need.name}); "
                        f"{args.checkpoint} holds a {have.title} model (task={have.name}): "
                        f"use srupp eval or {have.command}")
    return run


def _run_config(run_cfg: dict, task: str, overrides: List[str]):
    """The run's config (with ``overrides``), or the defaults of ``task`` for a bare
    checkpoint folder."""
    from .train import build_config

    if run_cfg:
        return build_config(None, overrides, base={**run_cfg, "task": task})
    return build_config(None, [f"task={task}", *overrides])


def cmd_eval(args) -> int:
    import torch

    from .inference import load_run

    run_cfg, tokenizer, model, ckpt = load_run(args.checkpoint)
    cfg = _run_config(run_cfg, model.config.task, args.set)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    # the weights: int8 computes in fp32, so that the scores show the weights' rounding alone
    from .inference import weights_in

    activations = weights_in(model, args.dtype, "fp32")
    if args.data:
        from .data import TABLES

        cfg.data.corpus = args.data
        if Path(args.data).is_dir() or args.data in TABLES:  # fixed splits: sizes do not apply
            cfg.data.test_size = cfg.data.valid_size = None
    if cfg.data.corpus is None:
        raise UserError(f"{args.checkpoint} names no data to evaluate on; give --data")
    result = cfg.task_class(cfg).evaluate_checkpoint(model, tokenizer, ckpt, args.split)
    print(json.dumps({**result, "split": args.split, "dtype": args.dtype,
                      "activations": activations, "checkpoint": str(ckpt)}))
    return 0


def cmd_generate(args) -> int:
    from .inference import generate_text, weights_for_decoding

    _, tokenizer, model, _ = _load_for(args, "generate")
    activations = weights_for_decoding(model, args.dtype)
    if not tokenizer.encode(args.prompt).numel():
        raise UserError("--prompt is empty: give at least one character")
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    start = time.perf_counter()
    out = generate_text(model, tokenizer, args.prompt, args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        mem_len=args.mem_len, seed=args.seed, on_text=_write)
    seconds = time.perf_counter() - start
    _write("\n")
    print(json.dumps({"prompt_tokens": out.prompt_tokens, "new_tokens": out.new_tokens,
                      "dtype": args.dtype, "activations": activations,
                      "seconds": round(seconds, 3),
                      "tokens_per_s": round(out.new_tokens / max(seconds, 1e-9), 1)}),
          file=sys.stderr)
    return 0


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_serve(args) -> int:
    from .serve import serve

    return serve(_load_for(args, "generate"), host=args.host, port=args.port, max_streams=args.max_streams,
                 max_queue=args.max_queue, sessions=args.sessions, dtype=args.dtype,
                 mem_len=args.mem_len, grace=args.grace, threads=args.threads,
                 chunk_ms=args.chunk_ms)


def cmd_export(args) -> int:
    from ._extras import require

    out = Path(args.out)
    if args.format == "hf":
        if args.mem_len is not None or args.quantize is not None:
            flag = "--mem-len" if args.mem_len is not None else "--quantize"
            raise UserError(f"{flag} applies to --format onnx only")
        require("transformers", "hf", "srupp export --format hf")
        from .hf import export_run_to_hf

        export_run_to_hf(Path(args.checkpoint), out)
        print(json.dumps({"format": "hf", "out": str(out)}))
        return 0
    from .inference import load_run
    from .onnx import check_exportable, check_torch_exports, export_onnx, resolve_window

    _, tokenizer, model, ckpt = load_run(args.checkpoint)
    with user_input():  # the model, window or torch the user has is one ONNX cannot take
        check_exportable(model)
        resolve_window(model, args.mem_len)
        check_torch_exports()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder for the ONNX graphs")
    start = time.perf_counter()
    if args.quantize is not None:
        require("onnxruntime", "onnx", "srupp export --quantize")
    info = export_onnx(model, out, mem_len=args.mem_len, tokenizer=tokenizer.to_dict(),
                       quantize=args.quantize)
    print(json.dumps({"format": "onnx", "out": str(out), "checkpoint": str(ckpt),
                      "weights": info["weights"],
                      "files": [*info["graphs"].values(), "srupp-onnx.json", "tokenizer.json"],
                      "window": info["window"], "state": info["state"],
                      "seconds": round(time.perf_counter() - start, 3)}))
    return 0


def _input_batches(stream, max_lines: int) -> Iterator[List[str]]:
    """Lines of ``stream`` in batches: as many as are already there, up to ``max_lines``.

    A batch is handed on as soon as no further complete line is waiting, so
    lines typed one by one are answered one by one, and a file is read in
    full batches.
    """
    fd = stream.fileno()
    pending, buf, eof = [], b"", False
    while not eof or pending:
        # wait for input only when there is nothing to hand on
        while not eof and len(pending) < max_lines:
            ready, _, _ = select.select([fd], [], [], None if not pending else 0)
            if not ready:
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                eof = True
                if buf:
                    pending.append(buf)
                    buf = b""
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            pending.extend(lines)
        if pending:
            batch, pending = pending[:max_lines], pending[max_lines:]
            yield [ln.decode("utf-8", errors="replace").rstrip("\r") for ln in batch]


def cmd_translate(args) -> int:
    import torch

    from .inference import encode_sources, translate_ids

    run_cfg, tokenizer, model, _ = _load_for(args, "translate")
    cfg = _run_config(run_cfg, model.config.task, [])
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = 0
    start = time.perf_counter()
    for batch in _input_batches(sys.stdin, args.batch_size):
        with user_input():  # a line longer than the model takes
            sources = encode_sources(tokenizer, batch, max_len=args.max_len or cfg.data.max_len,
                                     truncate=args.truncate or cfg.data.truncate,
                                     first_line=lines + 1)
        out = translate_ids(model, sources, beam=args.beam, lenpen=args.lenpen,
                            max_len_a=cfg.eval.max_len_a, max_len_b=cfg.eval.max_len_b,
                            no_repeat_ngram_size=args.no_repeat_ngram_size)
        sys.stdout.write("".join(tokenizer.decode(o) + "\n" for o in out))
        sys.stdout.flush()
        lines += len(batch)
    seconds = time.perf_counter() - start
    print(json.dumps({"sentences": lines, "seconds": round(seconds, 3), "beam": args.beam,
                      "sentences_per_s": round(lines / max(seconds, 1e-9), 2)}),
          file=sys.stderr)
    return 0


def cmd_classify(args) -> int:
    import torch

    from .inference import checked_labels, encode_texts, predict

    run_cfg, tokenizer, model, ckpt = _load_for(args, "classify")
    cfg = _run_config(run_cfg, model.config.task, [])
    labels = checked_labels(ckpt, model)
    if args.top_k is not None and not 1 <= args.top_k <= len(labels):
        raise UserError(f"--top-k must be between 1 and the number of labels ({len(labels)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = 0
    for batch in _input_batches(sys.stdin, args.batch_size):
        with user_input():  # a line longer than the model takes
            ids = encode_texts(tokenizer, batch, max_len=cfg.data.max_len,
                               truncate=cfg.data.truncate,
                               where=f"lines {lines + 1}-{lines + len(batch)} of the input")
        lines += len(batch)
        for p in predict(model, ids):
            best = int(p.argmax())
            record = {"label": labels[best], "prob": round(float(p[best]), 6)}
            if args.top_k:
                top = p.topk(args.top_k)
                record["top_k"] = [[labels[int(i)], round(float(v), 6)]
                                   for v, i in zip(top.values, top.indices)]
            sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    return 0


def cmd_params(args) -> int:
    from .data import build_tokenizer, load_corpus
    from .models import parameter_counts
    from .train import build_config

    cfg = build_config(args.recipe, args.set)
    if cfg.data.tokenizer == "byte":
        vocab = 256
    elif cfg.data.tokenizer in ("word", "sentencepiece"):
        # counted without reading data: the vocabulary is the recipe's cap
        if cfg.data.vocab_size is None:
            raise UserError(f"srupp params needs data.vocab_size for a {cfg.data.tokenizer} "
                            f"tokenizer; set it in the recipe or with --set data.vocab_size=N")
        vocab = cfg.data.vocab_size
    else:
        with user_input():
            vocab = build_tokenizer(cfg.data.tokenizer,
                                    load_corpus(cfg.data.corpus).train).vocab_size
    num_labels = cfg.task_class.output_labels(cfg)  # the output layer's width, if labels
    config = cfg.model_config(vocab, num_labels)
    out = {"type": config.type, **parameter_counts(config), "vocab_size": vocab}
    if num_labels is not None:
        out["num_labels"] = config.num_labels
    print(json.dumps(out))
    return 0


def cmd_compare(args) -> int:
    from .train.compare import compare

    if args.recipe and args.recipe_opt:
        raise UserError("give the recipe once: as RECIPE or as --recipe, not both")
    out = Path(args.out) if args.out else None
    results = compare(args.data, args.budget, args.params, models=args.models, out=out,
                      recipe=args.recipe or args.recipe_opt, overrides=args.set,
                      progress=not args.no_progress)
    print(json.dumps(results))
    return 0


def cmd_demo(args) -> int:
    from . import demo

    demo.main()
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, where a flag's value out of its range (a :func:`_number` type) is
    srupp's one line (``--top-p must be in (0, 1], got 2.0``), exit code 2."""

    def error(self, message: str):
        bad = re.match(r"argument (-[\w-]+)(?:/-[\w-]+)*: (must be .*)$", message)
        if bad is None:
            super().error(message)  # argparse's usage and message, exit code 2
        raise UserError(f"{bad[1]} {bad[2]}")


def _number(rng: str = "", *, integer: bool = False):
    """An argparse type: a number (an int with ``integer``), finite and in ``rng``
    (srupp._ranges: ">= 1", "(0, 1]", ...)."""
    from ._ranges import problem

    def parse(text: str):
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = text  # not a number: problem() says what it must be
        bad = problem(value, rng, integer=integer)
        if bad is not None:
            raise argparse.ArgumentTypeError(bad)
        return value

    parse.__name__ = "int" if integer else "float"
    return parse


_AT_LEAST_1 = _number(">= 1", integer=True)
_WINDOW = _number(">= 0", integer=True)  # --mem-len
# --dtype of eval, generate and serve (srupp.inference.DECODING_DTYPES, not imported here:
# the parser is built without torch; tests/test_cli.py checks the two agree)
_DECODING_DTYPES = ["fp32", "bf16", "int8", "w8a8"]


def _add_set(parser: argparse.ArgumentParser, help: Optional[str] = None) -> None:
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help=help)


def _train_parser(sub) -> None:
    """``srupp train``'s arguments."""
    t = sub.add_parser("train", help="train a model (task lm, translate or classify)")
    t.add_argument("recipe", nargs="?", help="a TOML recipe (default: built-in defaults)")
    t.add_argument("--data", help="lm: corpus name, text file or split directory; "
                                  "translate/classify: a TSV or a split directory")
    t.add_argument("--out", help="run directory (default: runs/<recipe name>)")
    _add_set(t, "override config fields, e.g. --set train.lr=1e-3 model.num_layers=6")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)


def _eval_parser(sub) -> None:
    """``srupp eval``'s arguments."""
    e = sub.add_parser("eval", help="evaluate a checkpoint; prints one JSON object")
    e.add_argument("--checkpoint", required=True, help="run directory or checkpoint folder")
    e.add_argument("--data", help="corpus (default: the run's)")
    e.add_argument("--split", choices=["valid", "test"], default="valid")
    e.add_argument("--dtype", choices=_DECODING_DTYPES, default="fp32",
                   help="weights: fp32 (default), bf16, int8 (one scale per output "
                        "channel, computed in fp32), or w8a8 (int8 weights, and each "
                        "layer's input rounded to int8 per row)")
    _add_set(e, "e.g. eval.unroll=512 eval.mem_len=1024 eval.batch_size=1, or eval.beam=1 "
                "eval.no_repeat_ngram_size=3")
    e.set_defaults(func=cmd_eval)


def _translate_parser(sub) -> None:
    """``srupp translate``'s arguments."""
    tr = sub.add_parser("translate", help="translate stdin line by line to stdout")
    tr.add_argument("--checkpoint", required=True, help="run directory or checkpoint folder")
    tr.add_argument("--beam", type=_AT_LEAST_1, default=5, help="beam size (1: greedy)")
    tr.add_argument("--lenpen", type=_number(">= 0"), default=1.0,
                    help="length penalty >= 0: a hypothesis scores log p / length**lenpen "
                         "(0: the plain sum)")
    tr.add_argument("--no-repeat-ngram-size", type=_number(">= 0", integer=True), default=0,
                    metavar="N", help="never repeat an n-gram of N output tokens (0: off)")
    tr.add_argument("--batch-size", type=_AT_LEAST_1, default=32,
                    help="sentences decoded together")
    tr.add_argument("--max-len", type=_AT_LEAST_1,
                    help="source tokens at most (default: the run's)")
    tr.add_argument("--truncate", action="store_true", help="cut longer sources, not an error")
    tr.add_argument("--threads", type=_AT_LEAST_1, help="torch threads")
    tr.set_defaults(func=cmd_translate)


def _classify_parser(sub) -> None:
    """``srupp classify``'s arguments."""
    cl = sub.add_parser("classify", help="label each line of stdin; one JSON line each")
    cl.add_argument("--checkpoint", required=True, help="run directory or checkpoint folder")
    cl.add_argument("--top-k", type=_AT_LEAST_1, help="also list the k most likely labels")
    cl.add_argument("--batch-size", type=_AT_LEAST_1, default=64,
                    help="texts classified together")
    cl.add_argument("--threads", type=_AT_LEAST_1, help="torch threads")
    cl.set_defaults(func=cmd_classify)


def _generate_parser(sub) -> None:
    """``srupp generate``'s arguments."""
    g = sub.add_parser("generate", help="generate text from a checkpoint")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=_number(">= 0", integer=True), default=200,
                   help="tokens to generate at most (default 200)")
    g.add_argument("--temperature", type=_number(">= 0"), default=0.8,
                   help="divides the logits before sampling (default 0.8); 0 is greedy: "
                        "the most likely token at each step, the same text every time")
    g.add_argument("--top-k", type=_AT_LEAST_1, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=_number("(0, 1]"),
                   help="sample among the most likely tokens that hold this much of the "
                        "probability, in (0, 1]")
    g.add_argument("--seed", type=_number("[0, 2**63)", integer=True), default=0,
                   help="the sampling's seed (default 0)")
    g.add_argument("--mem-len", type=_WINDOW, help="attention window (default: the model's)")
    g.add_argument("--dtype", choices=_DECODING_DTYPES, default="fp32",
                   help="weights while decoding: fp32, bf16 (half the bytes; needs a CPU "
                        "with bf16 instructions), int8 (a quarter; computes in bf16 where "
                        "the CPU has bf16 instructions, else fp32) or w8a8 (int8, with each "
                        "layer's input rounded to int8 too: integer products, VNNI where "
                        "the CPU has it)")
    g.set_defaults(func=cmd_generate)


def _serve_parser(sub) -> None:
    """``srupp serve``'s arguments."""
    sv = sub.add_parser("serve", help="serve a language model over HTTP (OpenAI's completions "
                                      "API); needs pip install 'srupp[serve]'")
    sv.add_argument("--checkpoint", required=True, help="run directory or checkpoint folder")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                                                         "127.0.0.1: this machine only)")
    sv.add_argument("--port", type=_number("[0, 65535]", integer=True), default=8000,
                    help="port (default 8000; 0: any free one)")
    sv.add_argument("--max-streams", type=_AT_LEAST_1, default=32,
                    help="streams decoded at once in one batched step (default 32)")
    sv.add_argument("--max-queue", type=_WINDOW, default=256,
                    help="requests waiting for a stream slot at most; more get 429 "
                         "(default 256)")
    sv.add_argument("--sessions", help="folder where sessions are saved, so that they "
                                       "survive a restart (default: no sessions)")
    sv.add_argument("--dtype", choices=_DECODING_DTYPES, default="fp32",
                    help="weights while decoding, as srupp generate's --dtype (default fp32)")
    sv.add_argument("--mem-len", type=_WINDOW,
                    help="attention window each stream keeps (default: the model's)")
    sv.add_argument("--grace", type=_number(">= 0"), default=30.0,
                    help="seconds streams in flight may run on after SIGTERM (default 30)")
    sv.add_argument("--chunk-ms", type=_number(">= 0"), default=40.0,
                    help="the batch decodes tokens in chunks of about this many ms, and "
                         "streams each stream's chunk as one event (default 40; less: "
                         "earlier first tokens and smaller events, at a lower rate; 0: every "
                         "token as it comes)")
    sv.add_argument("--threads", type=_AT_LEAST_1, help="torch threads")
    sv.set_defaults(func=cmd_serve)


def _export_parser(sub) -> None:
    """``srupp export``'s arguments."""
    ex = sub.add_parser("export", help="write a language model as ONNX graphs (or for "
                                       "Hugging Face transformers)")
    ex.add_argument("--checkpoint", required=True, help="run directory or checkpoint folder")
    ex.add_argument("--format", choices=["onnx", "hf"], default="onnx",
                    help="onnx: forward.onnx and step.onnx (srupp and sru models); "
                         "hf: a Hugging Face transformers folder")
    ex.add_argument("--out", required=True, help="folder to write (created if missing)")
    ex.add_argument("--mem-len", type=_WINDOW,
                    help="onnx: the step graph's attention window (default: the model's)")
    ex.add_argument("--quantize", choices=["int8"],
                    help="onnx: int8 weights, one scale per output channel, by ONNX "
                         "Runtime's quantize_dynamic (needs onnxruntime)")
    ex.set_defaults(func=cmd_export)


def _params_parser(sub) -> None:
    """``srupp params``'s arguments."""
    pa = sub.add_parser("params", help="count a recipe's parameters; prints JSON")
    pa.add_argument("recipe", nargs="?")
    _add_set(pa)
    pa.set_defaults(func=cmd_params)


def _compare_parser(sub) -> None:
    """``srupp compare``'s arguments."""
    c = sub.add_parser("compare", help="train SRU++ and baselines at equal size and time; "
                                       "writes results.json, results.md, curves.png")
    c.add_argument("recipe", nargs="?",
                   help="a TOML recipe: the task (lm, translate, classify), data, model and "
                        "training settings (default: language modelling with "
                        "recipes/brown-cpu.toml for brown, else shakespeare-cpu; with "
                        "--set task=translate or classify, the built-in defaults)")
    c.add_argument("--recipe", dest="recipe_opt", metavar="RECIPE",
                   help="the same as the RECIPE argument")
    c.add_argument("--data", required=True, help="lm: corpus name, text file or split "
                                                 "directory; translate/classify: a TSV or a "
                                                 "split directory")
    c.add_argument("--budget", type=_number("> 0"), required=True,
                   help="training seconds per model")
    c.add_argument("--params", type=_number("> 0", integer=True), required=True,
                   help="target parameter count (±10%%)")
    c.add_argument("--models", help="comma-separated; lm: srupp, sru, lstm, gru, transformer, "
                                    "srupp-attn-every-2, srupp-attn-last-1 (default: "
                                    "srupp,sru,lstm,gru,transformer); translate and classify: "
                                    "srupp, sru, lstm, transformer (default: all four)")
    c.add_argument("--out", help="output directory (default: runs/compare-<data>)")
    _add_set(c, "override config fields for every model, e.g. train.batch_size=8, "
                "or for one model with its name first, e.g. lstm:train.lr=3e-3")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compare)


def _demo_parser(sub) -> None:
    """``srupp demo``'s arguments."""
    d = sub.add_parser("demo", help="a small SRU++ forward/backward timing demo")
    d.set_defaults(func=cmd_demo)


# Each command's parser, in the order `srupp --help` lists them.
_COMMAND_PARSERS = (_train_parser, _eval_parser, _translate_parser, _classify_parser,
                    _generate_parser, _serve_parser, _export_parser, _params_parser,
                    _compare_parser, _demo_parser)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="srupp", description="SRU++ sequence models: language models, "
                                          "translation, classification")
    sub = p.add_subparsers(dest="command", required=True)
    for add in _COMMAND_PARSERS:
        add(sub)

    debug = "print the traceback of an error too (also SRUPP_DEBUG=1)"
    p.add_argument("--debug", action="store_true", help=debug)
    for command in sub.choices.values():  # also after the command; SUPPRESS keeps the global
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=debug)
    return p


def _one_line(text: str) -> str:
    return "; ".join(ln.strip() for ln in str(text).splitlines() if ln.strip())


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UserError as e:  # a flag's value out of its range (_Parser.error)
        return _error(_one_line(e))
    debug = args.debug or os.environ.get("SRUPP_DEBUG", "").strip().lower() not in (
        "", "0", "false", "no", "off")
    # This process is ours: keep freed activation buffers instead of re-faulting
    # them every step (srupp.allocator; SRUPP_TUNE_ALLOCATOR=0 opts out).
    from .allocator import tune_from_env
    tune_from_env()
    previous = warnings.showwarning
    warnings.showwarning = _warn_one_line
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("srupp: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        message = _user_message(e, args.command)
        if message is None:
            raise  # a bug: its traceback
        if debug:
            traceback.print_exc()
            return _error(message)
        return _error(f"{message} {DEBUG_HINT}")
    finally:
        warnings.showwarning = previous


DEBUG_HINT = "(--debug shows the traceback)"


def _user_message(e: Exception, command: str) -> Optional[str]:
    """The one line for an error the user can fix, or None for a bug."""
    if isinstance(e, ImportError):  # MissingExtra, or an optional package import
        from ._extras import EXTRA_OF, MissingExtra, install_hint

        if isinstance(e, MissingExtra):
            return _one_line(e)
        top = (e.name or "").split(".")[0]
        if top not in EXTRA_OF:
            return None  # a required package or srupp itself is broken
        return f"srupp {command} needs {top}, which is not installed: {install_hint(top)}"
    if isinstance(e, UserError):
        return _one_line(e) or type(e).__name__
    if isinstance(e, OSError):
        what = e.strerror or _one_line(e) or type(e).__name__
        paths = [str(f) for f in (e.filename, e.filename2) if f is not None]
        return f"{' -> '.join(paths)}: {what}" if paths else what
    return None


def _warn_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line on stderr, without the library's file and line."""
    print(f"srupp: warning: {_one_line(message)}", file=sys.stderr)


def _error(message: str) -> int:
    print(f"srupp: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
