r"""Translate German sentences into English with a trained checkpoint.

Command line::

    python -m transformer_tutorial.translate --checkpoint runs/small/best.pt \
        "Ein Mann fährt Fahrrad."
    python -m transformer_tutorial.translate --checkpoint runs/small/best.pt < sentences.de

One translation a line, in the order given.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from transformer_tutorial.checkpoint import CheckpointError, load_model
from transformer_tutorial.checks import ArgumentParser, device_arg, int_arg, number_arg
from transformer_tutorial.decode import BEAM_ALPHA, EXTRA_DECODE_TOKENS, translate_sentences
from transformer_tutorial.runtime import get_device


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m transformer_tutorial.translate",
        description="Translate German sentences into English with a checkpoint written by "
        "transformer_tutorial.train. Reads one sentence a line from standard "
        "input when no TEXT is given.",
    )
    parser.add_argument(
        "text", nargs="*", metavar="TEXT", help="German sentences to translate, one per argument"
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="best.pt or last.pt from a training run; its tokenizer.json must lie beside it",
    )
    parser.add_argument(
        "--beam",
        type=int_arg(at_least=1),
        default=5,
        help="beam size; 1 means greedy search; default: %(default)s",
    )
    parser.add_argument(
        "--max-len",
        type=int_arg(at_least=1),
        default=None,
        help="at most this many tokens a translation; "
        f"default: {EXTRA_DECODE_TOKENS} more than the source, "
        "within the model's max_len",
    )
    parser.add_argument(
        "--alpha",
        type=number_arg(low=0.0),
        default=BEAM_ALPHA,
        help="length penalty exponent of beam search, "
        "((5 + length) / 6) ** alpha; default: %(default)s",
    )
    parser.add_argument(
        "--device",
        type=device_arg,
        default=None,
        help="cpu, cuda, mps…; default: the best available",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 1

    device = get_device(args.device)  # the parser checked the flags (checks.py's converters)
    if args.text:
        sentences, where = args.text, "argument"
    else:
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            return fail(
                f"standard input is not UTF-8 text (byte {data[err.start]:#04x} at "
                f"offset {err.start}); convert it, e.g. with iconv -t utf-8"
            )
        sentences, where = text.splitlines(), "line"
    if not sentences:
        return fail("no text: pass German sentences as arguments or on standard input")
    for i, sentence in enumerate(sentences, start=1):
        if not sentence.strip():
            return fail(f"{where} {i} is empty")
    try:
        model, tokenizer, _ = load_model(args.checkpoint, device)
    except CheckpointError as err:
        return fail(str(err))
    except (OSError, ValueError) as err:  # the tokenizer beside it is missing or unreadable
        return fail(f"cannot load {args.checkpoint}: {err}")
    if tokenizer is None:
        return fail(
            f"{args.checkpoint} names no tokenizer; "
            "use a checkpoint written by transformer_tutorial.train"
        )
    try:
        translations = translate_sentences(
            model,
            tokenizer,
            [s.strip() for s in sentences],
            beam_size=args.beam,
            max_len=args.max_len,
            alpha=args.alpha,
        )
    except ValueError as err:
        return fail(str(err).replace("sentence", where, 1))
    print("\n".join(translations))
    return 0


if __name__ == "__main__":
    sys.exit(main())
