"""`polyformer train | generate | eval | convert | demo | datastore` (also `python -m polyformer ...`)."""

from __future__ import annotations

import argparse
import sys
import warnings

from ..keywords import closest
from .datastore_cmd import add_datastore_parser, add_knn_flags, knn_options
from .settings import EVAL_SETTINGS, PRESETS, settings_help


def overrides(extra: list[str], flags: list[str] | None = None) -> list[tuple[str, str]]:
    """['--model.depth', '4', '--train.bf16=true'] -> [('model.depth', '4'), ('train.bf16', 'true')];
    a dotted flag with no value means true, one with several values is their comma list
    (`--data.paths a.txt b.txt`). Anything else is an unknown flag, named with the closest of
    `flags` (the command's own flags)."""
    pairs, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            hint = closest(arg.split("=")[0], flags) if flags and arg.startswith("-") else ""
            raise SystemExit(f"polyformer: unknown flag {arg!r}{hint} (settings are given as --section.key VALUE, "
                             "e.g. --model.depth 4)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            values = []
            while i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                values.append(extra[i + 1])
                i += 1
            value = ",".join(values) if values else "true"
        pairs.append((name, value))
        i += 1
    return pairs


def flags_of(command: argparse.ArgumentParser) -> list[str]:
    return [f for action in command._actions for f in action.option_strings if f.startswith("--")]


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line (the usage is behind --help), an unknown command
    with the closest one."""

    def error(self, message: str) -> None:
        choice = message.split("invalid choice: ")[-1].split(" ")[0].strip("'") if "invalid choice" in message else ""
        hint = closest(choice, COMMANDS) if choice and self.prog == "polyformer" else ""
        raise SystemExit(f"{self.prog}: {message}{hint} (`{self.prog} --help` lists them)")


COMMANDS = ("train", "generate", "eval", "convert", "demo", "datastore")


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="polyformer", description="Train, evaluate and sample transformers.")
    sub = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser("train", help="train a model into a run directory",
                           description="Train a model. Any setting can be overridden as --section.key VALUE "
                                       "(sections: model, data, train; layer keywords as --model.layers.NAME).",
                           epilog=settings_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--out", required=True, help="run directory (created; with --resume, continued)")
    train.add_argument("--preset", choices=sorted(PRESETS), help="a starting point for the settings")
    train.add_argument("--config", help="a TOML or YAML file of settings, applied after the preset")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its last checkpoint (with the original command or "
                            "alone); past the steps the run was planned with, the learning rate holds its final value")
    train.add_argument("--steps", type=int, default=None, help="optimizer steps (same as --train.steps)")
    train.add_argument("--fsdp", action="store_true", help="shard with FSDP under torchrun (same as --train.fsdp)")
    train.add_argument("--allow-corpus-change", action="store_true",
                       help="with --resume: continue on the corpus as it is now, though files changed since the run "
                            "recorded it (without it, a changed corpus is refused, naming the files)")
    gen = sub.add_parser("generate", help="sample from a trained run")
    gen.add_argument("--run", required=True, help="run directory")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--prompt", default=None, help="text to continue (default: a line break)")
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--int8", action="store_true",
                     help="quantize the weights to int8 first (polyformer.quantize_int8; faster batch-1 decoding)")
    gen.add_argument("--draft", metavar="RUN_DIR", default=None,
                     help="a smaller run on the same tokenizer: speculative decoding, the same distribution (the "
                          "same text at --temperature 0), faster when the draft often agrees")
    gen.add_argument("--gamma", type=int, default=None, help="draft tokens proposed per target call (with --draft; "
                                                             "default 4)")
    gen.add_argument("--early-exit", type=float, default=None, metavar="THRESHOLD",
                     help="a model trained with exit_layers: each token stops at its first exit layer whose confidence "
                          "is above THRESHOLD (in [0, 1]; 1 never exits); the mean layers used go to stderr")
    add_knn_flags(gen)
    ev = sub.add_parser("eval", help="loss, perplexity and bits per byte of a run on its validation split, or on "
                                     "any text (--data.paths)",
                        description="Score a run's newest checkpoint: on its validation split (read from its "
                                    "corpus),\nor with --data.paths on every token of the files given, in windows of "
                                    "model.max_seq_len\ntokens, with the run's tokenizer.",
                        epilog="settings (--section.key VALUE, as train takes them):\n" + "\n".join(
                            f"  --{name:<24} {meaning}" for name, meaning in EVAL_SETTINGS.items()),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("--run", required=True, help="run directory")
    ev.add_argument("--batches", type=int, default=None, help="batches scored (default: the run's eval_batches on "
                                                              "the validation split, every window of --data.paths)")
    add_knn_flags(ev)
    add_datastore_parser(sub)
    conv = sub.add_parser("convert", help="a Hugging Face model directory into a run directory, or back",
                          description="Convert a Hugging Face GPT-2 / Llama model directory (config.json, "
                                      "model.safetensors, tokenizer.json) into a run directory that generate and "
                                      "eval accept, or a run directory into a Hugging Face model directory. With "
                                      "--from-hf, settings for eval can be given as --section.key VALUE (data.*, "
                                      "train.*, model.max_seq_len).")
    side = conv.add_mutually_exclusive_group(required=True)
    side.add_argument("--from-hf", metavar="DIR", help="a Hugging Face model directory to convert into --out")
    side.add_argument("--to-hf", metavar="RUN_DIR", help="a run directory to write as a Hugging Face model into --out")
    conv.add_argument("--out", required=True, help="the directory to create (must not exist, or be empty)")
    conv.add_argument("--ignore", action="append", default=[], metavar="NAME",
                      help="with --from-hf: leave out the checkpoint tensors with this name or prefix (e.g. pooler)")
    sub.add_parser("demo", help="the short built-in demo", add_help=False)
    return top


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr if file is None else file)


# errors a user's input causes (a missing or unreadable file, a bad value, an unknown setting): one line
EXPECTED = (OSError, ValueError, KeyError, TypeError)


def main(argv: list[str] | None = None) -> int:
    """Run one command. An expected error prints `polyformer: ...` on one line and exits with 2; the
    traceback only with --debug (anywhere on the line) or POLYFORMER_DEBUG=1 in the environment."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("POLYFORMER_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return _main(argv)
    except SystemExit as stop:          # a refusal's message: one line, and the usage errors' status
        if not isinstance(stop.code, str):
            raise
        print(stop.code, file=sys.stderr)
        return 2
    except EXPECTED as err:
        if debug:
            raise
        text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        if isinstance(err, OSError) and err.strerror and err.filename:
            text = f"{err.strerror}: {err.filename}"
        print(f"polyformer: {text} (--debug shows where)", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    warnings.showwarning = _one_line_warning       # a command line shows warnings as one line each
    if argv[:1] == ["demo"]:
        from .demo import main as demo

        demo(argv[1:])
        return 0
    top = parser()
    args, extra = top.parse_known_args(argv)
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    own = flags_of(commands[args.command])
    if args.command == "train":
        from .trainer import train

        pairs = overrides(extra, own)
        if args.steps is not None:
            pairs.append(("train.steps", str(args.steps)))
        if args.fsdp:
            pairs.append(("train.fsdp", "true"))
        return train(args.out, preset=args.preset, config_file=args.config, overrides=pairs, resume=args.resume,
                     corpus_change=args.allow_corpus_change)
    if args.command == "convert":
        from .convert import from_hf_dir, to_hf_dir

        if args.from_hf is not None:
            return from_hf_dir(args.from_hf, args.out, args.ignore, overrides(extra, own))
        if extra or args.ignore:
            raise SystemExit(f"polyformer convert --to-hf: unknown flag(s) {extra + ['--ignore'] * bool(args.ignore)}")
        return to_hf_dir(args.to_hf, args.out)
    if args.command == "eval":
        from .commands import evaluate_run

        return evaluate_run(args.run, args.batches, overrides(extra, own), knn=knn_options(args, "eval"))
    if args.command == "datastore":
        from .datastore_cmd import datastore_command

        return datastore_command(args, overrides(extra, own))
    if extra and extra[0].startswith("--") and "." in extra[0].split("=")[0]:
        raise SystemExit(f"polyformer generate: {extra[0]} does not apply: generate samples from the run's model with "
                         "its tokenizer, and reads no corpus (the text to continue is --prompt)")
    if extra:
        hint = closest(extra[0].split("=")[0], own) if extra[0].startswith("-") else ""
        raise SystemExit(f"polyformer {args.command}: unknown flag(s) {extra}{hint}")
    from .commands import generate

    return generate(args.run, args.max_new_tokens, args.prompt, args.temperature, args.top_k, args.top_p,
                    args.seed, int8=args.int8, draft=args.draft, gamma=args.gamma, knn=knn_options(args, "generate"),
                    early_exit=args.early_exit)
