"""The ``srupp`` command: train, eval, generate, params, compare, demo.

Problems with the user's input print one line on stderr and exit with code 2:
a ``UserError``, any ``ValueError`` or ``TypeError`` the library raises for bad
arguments, an ``OSError`` (with the file it concerns) and a missing optional
package (with the ``pip install`` line that adds it). Ctrl-C and SIGTERM exit
with code 130.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

from .errors import UserError


def cmd_train(args) -> int:
    from .train import Trainer, build_config
    from .train.checkpoint import read_json

    out = Path(args.out) if args.out else Path("runs") / (Path(args.recipe).stem if args.recipe
                                                         else "default")
    overrides = list(args.set)
    if args.data:
        overrides.append(f"data.corpus={args.data}")
    base = None
    if args.resume:
        if not (out / "config.json").exists():
            raise UserError(f"--resume: {out} holds no run to resume (no config.json)")
        base = read_json(out / "config.json", "run config")
    cfg = build_config(args.recipe, overrides, base=base)
    trainer = Trainer(cfg, out, resume=args.resume, progress=not args.no_progress)
    print(f"srupp: training {trainer.model.num_parameters():,} parameters into {out} "
          f"({cfg.data.corpus}, {cfg.data.tokenizer} tokens, precision {trainer.precision})",
          file=sys.stderr)
    summary = trainer.train()
    print(json.dumps(summary))
    return 130 if summary["interrupted"] else 0


def cmd_eval(args) -> int:
    import torch

    from .data import load_corpus
    from .train import build_config, evaluate
    from .train.checkpoint import load_run
    from .train.evaluate import metric_for
    from .train.trainer import check_tokenizer_fits

    run_cfg, tokenizer, model, ckpt = load_run(args.checkpoint)
    cfg = build_config(None, args.set, base=run_cfg or None)
    corpus = load_corpus(args.data or cfg.data.corpus)
    text = corpus.split(args.split)
    oov = check_tokenizer_fits(tokenizer, text, cfg.data.max_oov, f"the {args.split} split")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    res = evaluate(model, tokenizer.encode(text), batch_size=cfg.eval.batch_size,
                   unroll=cfg.eval.unroll or cfg.train.unroll, mem_len=cfg.eval.mem_len,
                   precision="fp32")
    metric = metric_for(tokenizer)  # bits per character, or perplexity per token
    print(json.dumps({metric: res[metric], "loss": res["loss"], "tokens": res["tokens"],
                      "seconds": res["seconds"], "oov_rate": oov, "split": args.split,
                      "checkpoint": str(ckpt)}))
    return 0


class _Streamer:
    """Prints the decoded text of growing id lists, holding back incomplete characters."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def __call__(self, tokens) -> None:
        t = int(tokens[0])
        if t < 0:
            return
        self.ids.append(t)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return  # maybe half of a multi-byte character
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text

    def finish(self, ids) -> None:
        text = self.tokenizer.decode(ids)
        sys.stdout.write(text[len(self.printed):] if text.startswith(self.printed) else "")
        sys.stdout.write("\n")
        sys.stdout.flush()


def cmd_generate(args) -> int:
    import torch

    from .train.checkpoint import load_run

    if args.max_new_tokens < 0:
        raise UserError("--max-new-tokens must be >= 0")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError("--top-p must be in (0, 1]")
    if args.top_k is not None and args.top_k < 1:
        raise UserError("--top-k must be >= 1")
    _, tokenizer, model, _ = load_run(args.checkpoint)
    prompt_ids = tokenizer.encode(args.prompt).tolist()
    if not prompt_ids:
        raise UserError("--prompt is empty: give at least one character")
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    stream = _Streamer(tokenizer)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    new = model.generate([prompt_ids], args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, mem_len=args.mem_len,
                         generator=gen, on_tokens=stream)[0]
    seconds = time.perf_counter() - start
    stream.finish(new)
    print(json.dumps({"prompt_tokens": len(prompt_ids), "new_tokens": len(new),
                      "seconds": round(seconds, 3),
                      "tokens_per_s": round(len(new) / max(seconds, 1e-9), 1)}), file=sys.stderr)
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
        vocab = build_tokenizer(cfg.data.tokenizer, load_corpus(cfg.data.corpus).train).vocab_size
    config = cfg.model_config(vocab)
    out = {"type": config.type, **parameter_counts(config), "vocab_size": vocab}
    print(json.dumps(out))
    return 0


def cmd_compare(args) -> int:
    from .train.compare import compare

    out = Path(args.out) if args.out else None
    results = compare(args.data, args.budget, args.params, models=args.models, out=out,
                      recipe=args.recipe, overrides=args.set,
                      progress=not args.no_progress)
    print(json.dumps(results))
    return 0


def cmd_demo(args) -> int:
    from . import demo

    demo.main()
    return 0


def _add_set(parser: argparse.ArgumentParser, help: Optional[str] = None) -> None:
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help=help)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="srupp", description="SRU++ language models")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a language model")
    t.add_argument("recipe", nargs="?", help="a TOML recipe (default: built-in defaults)")
    t.add_argument("--data", help="corpus name, text file or split directory")
    t.add_argument("--out", help="run directory (default: runs/<recipe name>)")
    _add_set(t, "override config fields, e.g. --set train.lr=1e-3 model.num_layers=6")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint; prints one JSON object")
    e.add_argument("--checkpoint", required=True, help="run directory or checkpoint folder")
    e.add_argument("--data", help="corpus (default: the run's)")
    e.add_argument("--split", choices=["valid", "test"], default="valid")
    _add_set(e, "e.g. eval.unroll=512 eval.mem_len=1024 eval.batch_size=1")
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="generate text from a checkpoint")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mem-len", type=int, help="attention window (default: the model's)")
    g.set_defaults(func=cmd_generate)

    pa = sub.add_parser("params", help="count a recipe's parameters; prints JSON")
    pa.add_argument("recipe", nargs="?")
    _add_set(pa)
    pa.set_defaults(func=cmd_params)

    c = sub.add_parser("compare", help="train SRU++ and baselines at equal size and time; "
                                       "writes results.json, results.md, curves.png")
    c.add_argument("--data", required=True, help="corpus name, text file or split directory")
    c.add_argument("--budget", type=float, required=True, help="training seconds per model")
    c.add_argument("--params", type=int, required=True, help="target parameter count (±10%%)")
    c.add_argument("--models", help="comma-separated: srupp, sru, lstm, gru, transformer, "
                                    "srupp-attn-every-2, srupp-attn-last-1 "
                                    "(default: srupp,sru,lstm,gru,transformer)")
    c.add_argument("--out", help="output directory (default: runs/compare-<data>)")
    c.add_argument("--recipe", help="recipe for data and training settings (default: "
                                    "recipes/brown-cpu.toml for brown, else shakespeare-cpu)")
    _add_set(c, "override config fields for every model, e.g. train.batch_size=8, "
                "or for one model with its name first, e.g. lstm:train.lr=3e-3")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compare)

    d = sub.add_parser("demo", help="a small SRU++ forward/backward timing demo")
    d.set_defaults(func=cmd_demo)
    return p


def _one_line(text: str) -> str:
    return "; ".join(ln.strip() for ln in str(text).splitlines() if ln.strip())


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # This process is ours: keep freed activation buffers instead of re-faulting
    # them every step (srupp.allocator; SRUPP_TUNE_ALLOCATOR=0 opts out).
    from .allocator import tune_from_env
    tune_from_env()
    try:
        return args.func(args)
    except (UserError, ValueError, TypeError) as e:
        return _error(_one_line(e) or type(e).__name__)
    except ImportError as e:  # MissingExtra is a ValueError, handled above
        from ._extras import EXTRA_OF, install_hint

        top = (e.name or "").split(".")[0]
        if top not in EXTRA_OF:
            raise  # a required package or srupp itself is broken: a bug, keep the traceback
        return _error(f"srupp {args.command} needs {top}, which is not installed: "
                      f"{install_hint(top)}")
    except OSError as e:
        what = e.strerror or _one_line(e) or type(e).__name__
        paths = [str(f) for f in (e.filename, e.filename2) if f is not None]
        return _error(f"{' -> '.join(paths)}: {what}" if paths else what)
    except KeyboardInterrupt:
        print("srupp: interrupted", file=sys.stderr)
        return 130


def _error(message: str) -> int:
    print(f"srupp: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
