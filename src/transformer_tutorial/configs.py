"""Chapter 10: what to train and how — named recipes (:class:`TrainConfig`) and the options of
one run of a recipe (:class:`RunOptions`).

``CONFIGS`` is the one registry of recipes: the trainer's CLI, the chapters and the benchmarks
all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformer_tutorial.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_optional_int,
)
from transformer_tutorial.data import BATCH_TOKENS, PAD_ID
from transformer_tutorial.decode import BEAM_ALPHA
from transformer_tutorial.model import TransformerConfig
from transformer_tutorial.optim import paper_peak_lr
from transformer_tutorial.precision import PRECISIONS
from transformer_tutorial.runtime import check_device


@dataclass(frozen=True)
class TrainConfig:
    """A named recipe: the model (its ``vocab_size`` is the joint BPE vocabulary to train) and how
    to train it.

    ``max_tokens`` is the padded size of a batch (longest pair × pairs); ``lr`` the peak learning
    rate; ``eval_every`` also evaluates every so many steps (0: once an epoch); ``train_size`` and
    ``eval_size`` cut the training set and the test set used for BLEU (None: all);
    ``beam_size`` and ``alpha`` are the beam search that scores the run. With ``steps`` the run
    is that many optimizer steps long and its learning rate decays linearly to zero at the end
    (:class:`~transformer_tutorial.optim.LinearDecay`), or at the last step a time limit holds
    when that comes first (:mod:`~transformer_tutorial.budget`); without, it follows the paper's
    inverse square root for ``epochs``. With ``average_last``
    above 1 the run is scored with the mean of the weights saved at its last ``average_last``
    checkpoints (every ``checkpoint_every`` steps, and the last step), as the paper scores its
    base models (section 6.1: "averaging the last 5 checkpoints"); with 1, with ``best.pt``.
    """

    name: str
    model: TransformerConfig
    max_tokens: int = BATCH_TOKENS
    lr: float = 1e-3
    warmup: int = 800
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    epochs: int = 100
    steps: int | None = None
    log_every: int = 20
    eval_every: int = 0
    checkpoint_every: int = 200
    train_size: int | None = None
    eval_size: int | None = None
    beam_size: int = 5
    alpha: float = BEAM_ALPHA
    average_last: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, TransformerConfig):
            raise TypeError(f"model must be a TransformerConfig, got {type(self.model).__name__}")
        for name in ("max_tokens", "warmup", "epochs", "log_every", "beam_size", "average_last"):
            check_int(name, getattr(self, name), at_least=1)
        for name in ("eval_every", "checkpoint_every"):
            check_int(name, getattr(self, name), at_least=0)
        for name in ("train_size", "eval_size", "steps"):
            check_optional_int(name, getattr(self, name), at_least=1)
        check_number("lr", self.lr, low=0.0, low_open=True)
        check_number("label_smoothing", self.label_smoothing, low=0.0, high=1.0, high_open=True)
        check_number("clip_norm", self.clip_norm, low=0.0, low_open=True)
        check_number("alpha", self.alpha, low=0.0)
        if self.steps is not None and self.steps <= self.warmup:
            raise ValueError(
                f"steps={self.steps} must be more than warmup={self.warmup}: the learning rate "
                "decays to zero after the warm-up"
            )
        if self.average_last > 1 and not self.checkpoint_every:
            raise ValueError(
                f"average_last={self.average_last} averages checkpoints, so checkpoint_every "
                "must be at least 1, got 0"
            )

    @property
    def vocab_size(self) -> int:
        """The size of the joint source–target vocabulary the tokenizer is trained for."""
        return self.model.src_vocab_size

    def model_config(self, vocab_size: int) -> TransformerConfig:
        """The model for a tokenizer of ``vocab_size`` tokens (BPE may learn fewer than asked)."""
        return replace(self.model, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size)


def translator_config(vocab_size: int = 8000, **sizes) -> TransformerConfig:
    """A translator with one joint vocabulary: shared, tied embeddings, pre-norm; ``sizes``
    override :class:`TransformerConfig`'s fields (its defaults are the paper's base model)."""
    defaults = dict(
        d_model=256,
        n_heads=8,
        n_encoder_layers=3,
        n_decoder_layers=3,
        d_ff=1024,
        max_len=256,
        norm_first=True,
        pad_id=PAD_ID,
        share_embeddings=True,
        tie_output=True,
    )
    return TransformerConfig(vocab_size, vocab_size, **{**defaults, **sizes})


CONFIGS = {
    # Seconds on a CPU: for tests and CI. Learns little.
    "tiny": TrainConfig(
        "tiny",
        translator_config(
            500,
            d_model=32,
            n_heads=2,
            n_encoder_layers=2,
            n_decoder_layers=2,
            d_ff=64,
            max_len=128,
        ),
        max_tokens=1000,
        lr=3e-3,
        warmup=20,
        epochs=2,
        log_every=5,
        eval_every=20,
        checkpoint_every=20,
        train_size=2000,
        eval_size=50,
        beam_size=2,
    ),
    # Chapter 10's own run on a CPU, 600 steps (a minute or two): small made narrower,
    # shallower and with half its vocabulary; at d_model 128 an 8,000-token output layer and
    # softmax were a third of each step (measured on 2 cores: 4,000 tokens trained 25% faster
    # and scored no lower). It sees about one epoch, so no dropout, and many small batches at a
    # higher learning rate.
    "chapter10": TrainConfig(
        "chapter10",
        translator_config(
            4000,
            d_model=128,
            n_heads=4,
            n_encoder_layers=2,
            n_decoder_layers=2,
            d_ff=512,
            dropout=0.0,
        ),
        max_tokens=1000,
        lr=3e-3,
        warmup=50,
        log_every=5,
        eval_every=100,
        checkpoint_every=100,
        eval_size=100,
    ),
    # The CPU reference, an hour on 2 cores: the baseline's model (d_model 256, 3+3 layers) with
    # batches of 3,000 tokens and a 400-step warm-up. 3,600 steps fit an hour on 2 cores of the
    # build machine (the reference run: 57.0 min, 0.95 s a step with evaluation between epochs);
    # the learning rate decays to zero just after the last of them (on a slower machine
    # `--max-minutes 60` ends the decay at the last step the hour holds). That is 23 epochs of
    # Multi30k: at dropout 0.1 the validation loss turned up after 15, so 0.2. The mean of the
    # last 5 checkpoints (200 steps apart) is scored, as in the paper.
    "small": TrainConfig(
        "small",
        translator_config(dropout=0.2),
        max_tokens=3000,
        warmup=400,
        steps=3600,
        average_last=5,
    ),
    # The paper's base model and schedule (Table 3, section 5.3), for a GPU.
    "base": TrainConfig(
        "base",
        translator_config(
            d_model=512,
            n_heads=8,
            n_encoder_layers=6,
            n_decoder_layers=6,
            d_ff=2048,
            norm_first=False,
        ),
        max_tokens=8000,
        lr=paper_peak_lr(512, 4000),
        warmup=4000,
    ),
}


@dataclass(frozen=True)
class RunOptions:
    """How to run a recipe, as opposed to what it is (:class:`TrainConfig`).

    Training stops after ``config.epochs`` epochs, ``max_steps`` optimizer steps in all, or
    ``max_minutes`` of this call, whichever comes first; for a recipe with ``steps``,
    ``max_minutes`` also ends the learning rate's decay at the last step it holds, measured as
    the run goes (:mod:`~transformer_tutorial.budget`). With ``resume`` it goes on from
    ``out_dir/last.pt`` exactly as if it had never stopped. ``precision`` is one of
    :data:`~transformer_tutorial.precision.PRECISIONS` (``"auto"``: bf16 or fp16 on a CUDA GPU,
    fp32 elsewhere); ``compile`` runs the training step's forward and backward through
    ``torch.compile``.
    """

    device: str = "cpu"
    seed: int = 0
    resume: bool = False
    max_steps: int | None = None
    max_minutes: float | None = None
    progress: bool = True
    precision: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        check_int("seed", self.seed, at_least=0)
        check_choice("precision", self.precision, PRECISIONS)
        for name in ("resume", "progress", "compile"):
            check_bool(name, getattr(self, name))
        check_optional_int("max_steps", self.max_steps, at_least=1)
        if self.max_minutes is not None:
            check_number("max_minutes", self.max_minutes, low=0.0, low_open=True)
        check_device(self.device)
