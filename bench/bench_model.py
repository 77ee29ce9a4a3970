"""Speed of the book's Transformer as a ratio to PyTorch's nn.Transformer, measured in one run.

    python bench/bench_model.py                      # the model of the small recipe, CPU
    python bench/bench_model.py --config base --device cuda --dtype bfloat16

The models are those of the training recipes in ``transformer_tutorial.configs.CONFIGS``.

Both models get the same embeddings-and-generator wrapper, the same batch (token ids with
padding) and the same masks; each timing is the median of --repeats runs after --warmup, the two
models interleaved so that a busy machine slows both alike. Reported: forward (eval, no grad)
and forward+backward (train mode, dropout on) per batch, and the ratio ours / PyTorch (< 1 is
faster). A ratio, never an absolute time, is what to compare across machines.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from torch import nn

from transformer_tutorial import get_device, set_seed
from transformer_tutorial.configs import CONFIGS
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.model import Transformer


class TorchTransformer(nn.Module):
    """nn.Transformer between the book's embeddings and generator: the reference to beat."""

    def __init__(self, ours: Transformer) -> None:
        super().__init__()
        c = ours.config
        self.src_embed, self.tgt_embed, self.positional = (
            ours.src_embed,
            ours.tgt_embed,
            ours.positional,
        )
        self.pad_id = c.pad_id
        self.core = nn.Transformer(
            c.d_model,
            c.n_heads,
            c.n_encoder_layers,
            c.n_decoder_layers,
            c.d_ff,
            c.dropout,
            batch_first=True,
            norm_first=c.norm_first,
        )
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        src_pad, tgt_pad = src == self.pad_id, tgt == self.pad_id
        out = self.core(
            self.positional(self.src_embed(src)),
            self.positional(self.tgt_embed(tgt)),
            tgt_mask=causal_mask(tgt.size(1), device=tgt.device),
            tgt_is_causal=True,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )
        return self.generator(out)


def batch(
    vocab: int, batch_size: int, length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids with realistic padding: lengths spread between 60% and 100% of ``length``."""
    lengths = torch.linspace(0.6 * length, length, batch_size).long()
    ids = torch.randint(4, vocab, (2, batch_size, length), device=device)
    keep = torch.arange(length)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~keep.to(device), 0)
    return ids[0], ids[1]


def timed(fn, repeats: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", choices=sorted(CONFIGS), default="small", help="recipe's model"
    )
    parser.add_argument(
        "--vocab", type=int, default=None, help="joint vocabulary size (default: the recipe's)"
    )
    parser.add_argument("--batch-size", type=int, default=128, help="sentences per batch")
    parser.add_argument(
        "--length", type=int, default=30, help="longest sentence in the batch (tokens)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: best available)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="autocast dtype"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    args = parser.parse_args()

    set_seed(0)
    device = get_device(args.device)
    recipe = CONFIGS[args.config]
    vocab = args.vocab or recipe.vocab_size
    config = recipe.model_config(vocab)
    ours = Transformer(config).to(device)
    theirs = TorchTransformer(ours).to(device)
    src, tgt = batch(vocab, args.batch_size, args.length, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def forward(model):
        model.eval()
        with torch.no_grad(), autocast:
            model(src, tgt)

    def train_step(model):
        model.train()
        with autocast:
            loss = model(src, tgt).float().logsumexp(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    print(
        f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"config {args.config}, batch {args.batch_size}×{args.length}, dtype {args.dtype}"
    )
    for name, fn in [("forward", forward), ("forward+backward", train_step)]:
        ours_t, theirs_t = [], []
        for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
            ours_t += timed(partial(fn, ours), 1, args.warmup if not ours_t else 0, device)
            theirs_t += timed(partial(fn, theirs), 1, args.warmup if not theirs_t else 0, device)
        a, b = statistics.median(ours_t), statistics.median(theirs_t)
        print(
            f"{name:<17} ours {a * 1e3:8.1f} ms   nn.Transformer {b * 1e3:8.1f} ms   "
            f"ratio {a / b:.2f}"
        )


if __name__ == "__main__":
    main()
