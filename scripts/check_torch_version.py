"""``make check-torch``: fail in one line when the venv's torch is not the one asked for.

``pip install -r requirements.txt`` replaces an older torch it does not accept (transformers 5
needs torch >= 2.6), so ``TORCH=2.5.1`` would otherwise test whatever pip chose instead.

    python scripts/check_torch_version.py 2.6.0
"""

from __future__ import annotations

import sys

import torch


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/check_torch_version.py VERSION", file=sys.stderr)
        return 2
    wanted, have = argv[0], torch.__version__.split("+")[0]
    if have != wanted:
        print(
            f"check-torch: asked for torch {wanted}, but the venv has {have}: pip replaced it "
            "while installing requirements.txt, which needs torch >= 2.6",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
