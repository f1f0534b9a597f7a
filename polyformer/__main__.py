"""`python -m polyformer COMMAND`: the command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "train a small decoder on the built-in corpus and print a sample"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        lines = "\n".join(f"  {name:8s} {text}" for name, text in commands.items())
        print(f"usage: polyformer COMMAND [options]\n\ncommands:\n{lines}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\npolyformer: unknown command {argv[0]!r}", file=sys.stderr)
            sys.exit(2)
        return
    if argv[0] == "demo":
        from .train.demo import main as demo

        demo(argv[1:])


if __name__ == "__main__":
    main()
