"""Command-line entry point (``srupp``)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="srupp", description="srupp command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run a small SRU++ forward/backward timing demo")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from srupp import demo

        demo.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
