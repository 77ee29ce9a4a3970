"""Every public boundary answers a user's mistake with a clear error before PyTorch does.

One table per boundary: each row is a bad input, the exception it must raise, and a phrase the
message must contain (the argument's name and what would be valid). The command lines print one
line, exit 1 (130 when interrupted) and show no traceback; an interrupted run loses nothing.
Removing any check from the package makes its row fail.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from transformer_tutorial import train as train_cli
from transformer_tutorial import translate as translate_cli
from transformer_tutorial.attention import MultiHeadAttention, scaled_dot_product_attention
from transformer_tutorial.checkpoint import CheckpointError, load_model
from transformer_tutorial.configs import CONFIGS
from transformer_tutorial.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    DatasetUnavailableError,
    data_dir,
    load_tokenizer,
)
from transformer_tutorial.decode import beam_search, bleu, greedy_decode, translate_sentences
from transformer_tutorial.runtime import get_device
from transformer_tutorial.trainer import RunOptions, Trainer, TrainingInterrupted, fit


def raises(call, error: type[Exception], phrase: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert phrase in str(info.value), f"{phrase!r} not in {str(info.value)!r}"


# --- TransformerConfig: every field ------------------------------------------------------------

CONFIG_ROWS = [
    ({"n_heads": 0}, ValueError, "n_heads must be at least 1, got 0"),
    ({"n_heads": 3}, ValueError, "d_model=16 must be divisible by n_heads=3"),
    ({"n_encoder_layers": -1}, ValueError, "n_encoder_layers must be at least 1, got -1"),
    ({"n_decoder_layers": 0}, ValueError, "n_decoder_layers must be at least 1, got 0"),
    ({"d_ff": -4}, ValueError, "d_ff must be at least 1, got -4"),
    ({"max_len": -1}, ValueError, "max_len must be at least 1, got -1"),
    ({"d_model": 15, "n_heads": 5}, ValueError, "d_model=15 must be even"),
    ({"d_model": 16.0}, TypeError, "d_model must be an int, got 16.0"),
    ({"src_vocab_size": 0}, ValueError, "src_vocab_size must be at least 1, got 0"),
    ({"tgt_vocab_size": True}, TypeError, "tgt_vocab_size must be an int"),
    ({"dropout": 1.5}, ValueError, "dropout must be in [0.0, 1.0), got 1.5"),
    ({"dropout": -0.1}, ValueError, "dropout must be in [0.0, 1.0)"),
    ({"dropout": float("nan")}, ValueError, "dropout must be in"),
    ({"layer_norm_eps": 0.0}, ValueError, "layer_norm_eps must be greater than 0.0"),
    ({"activation": "tanh"}, ValueError, "activation must be one of ['gelu', 'relu']"),
    ({"norm_first": "yes"}, TypeError, "norm_first must be True or False"),
    ({"pad_id": 20}, ValueError, "pad_id=20 is not an id of both vocabularies"),
    ({"pad_id": -1}, ValueError, "pad_id must be at least 0"),
    ({"share_embeddings": True}, ValueError, "share_embeddings needs one joint vocabulary"),
]


@pytest.mark.parametrize(("changes", "error", "phrase"), CONFIG_ROWS, ids=str)
def test_transformer_config(changes, error, phrase):
    raises(lambda: tiny_config(**changes), error, phrase)


# --- The model's inputs --------------------------------------------------------------------------

SRC = torch.tensor([[3, 4, 5, PAD_ID], [6, 7, 8, 9]])
TGT = torch.tensor([[BOS_ID, 3, 4], [BOS_ID, 5, PAD_ID]])
MODEL_ROWS = [
    (
        "src id = V",
        lambda m: m(torch.tensor([[3, 11]]), TGT[:1]),
        ValueError,
        "valid ids are 0 to 10 (the vocabulary has 11 tokens)",
    ),
    (
        "negative tgt id",
        lambda m: m(SRC, torch.tensor([[1, -2, 3], [1, 2, 3]])),
        ValueError,
        "tgt holds ids from -2 to 3; valid ids are 0 to 12",
    ),
    ("float ids", lambda m: m(SRC.float(), TGT), TypeError, "src must hold integer token ids"),
    ("1-D ids", lambda m: m(SRC[0], TGT), ValueError, "src must be token ids of shape (B, L)"),
    (
        "batch mismatch",
        lambda m: m(SRC, TGT[:1]),
        ValueError,
        "src and tgt must hold the same number of sentences: src has 2 rows",
    ),
    ("too long", lambda m: m(torch.full((1, 40), 3), TGT[:1]), ValueError, "beyond max_len=32"),
    (
        "memory width",
        lambda m: m.decode(TGT, torch.zeros(2, 4, 8)),
        ValueError,
        "memory must be the encoder's output (B, S, D) = (2, S, 16)",
    ),
    (
        "memory batch",
        lambda m: m.decode(TGT, torch.zeros(3, 4, 16)),
        ValueError,
        "memory must be the encoder's output",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "phrase"), [r[1:] for r in MODEL_ROWS], ids=[r[0] for r in MODEL_ROWS]
)
def test_model_inputs(tiny_model, call, error, phrase):
    model = tiny_model()
    raises(lambda: call(model), error, phrase)


# --- Attention -----------------------------------------------------------------------------------

X = torch.randn(2, 5, 8)
MHA_ROWS = [
    (
        "key/value lengths",
        lambda m: m(X, torch.randn(2, 6, 8), torch.randn(2, 7, 8)),
        ValueError,
        "key and value must have the same (B, S)",
    ),
    (
        "key width",
        lambda m: m(X, torch.randn(2, 6, 4), torch.randn(2, 6, 4)),
        ValueError,
        "query, key and value must be batch-first (B, L, D=8)",
    ),
    ("query width", lambda m: m(torch.randn(2, 5, 6), X, X), ValueError, "(B, L, D=8)"),
    (
        "batch",
        lambda m: m(X, X[:1], X[:1]),
        ValueError,
        "query and key must have the same batch size B",
    ),
    (
        "mask heads",
        lambda m: m(X, X, X, attn_mask=torch.zeros(2, 3, 5, 5, dtype=torch.bool)),
        ValueError,
        "(B, H, L, S) = (2, 2, 5, 5)",
    ),
    (
        "mask batch",
        lambda m: m(X, X, X, attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool)),
        ValueError,
        "(B, L, S) = (2, 5, 5)",
    ),
    (
        "padding mask length",
        lambda m: m(X, X, X, key_padding_mask=torch.zeros(2, 4).bool()),
        ValueError,
        "key_padding_mask has shape (2, 4); expected (B, S) = (2, 5)",
    ),
    (
        "float mask",
        lambda m: m(X, X, X, attn_mask=torch.zeros(5, 5)),
        TypeError,
        "attn_mask must be a bool tensor with True = blocked",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "phrase"), [r[1:] for r in MHA_ROWS], ids=[r[0] for r in MHA_ROWS]
)
@pytest.mark.parametrize("need_weights", [False, True])
def test_multi_head_attention_inputs(call, error, phrase, need_weights):
    mha = MultiHeadAttention(8, 2)
    forward = mha.forward
    mha.forward = lambda *a, **k: forward(*a, need_weights=need_weights, **k)
    raises(lambda: call(mha), error, phrase)


@pytest.mark.parametrize(
    ("args", "error", "phrase"),
    [
        ((8, 0), ValueError, "n_heads must be at least 1, got 0"),
        ((8, 3), ValueError, "d_model=8 must be divisible by n_heads=3"),
        ((0, 1), ValueError, "d_model must be at least 1"),
        ((8, 2, 1.5), ValueError, "dropout must be in [0.0, 1.0], got 1.5"),
        ((8, 2, -0.1), ValueError, "dropout must be in [0.0, 1.0]"),
    ],
    ids=str,
)
def test_multi_head_attention_construction(args, error, phrase):
    raises(lambda: MultiHeadAttention(*args), error, phrase)


Q = torch.randn(2, 2, 5, 4)
SDPA_ROWS = [
    ("k/v lengths", (Q, torch.randn(2, 2, 6, 4), torch.randn(2, 2, 7, 4)), {}, "k and v the same"),
    ("q/k widths", (Q, torch.randn(2, 2, 6, 3), torch.randn(2, 2, 6, 3)), {}, "the width Dk of k"),
    ("q/k batch", (Q, Q[:1], Q[:1]), {}, "q the same (B, [H])"),
    ("ranks", (Q, Q[0], Q[0]), {}, "must all be (B, L, Dk) or all (B, H, L, Dk)"),
    ("dropout_p", (Q, Q, Q), {"dropout_p": 2.0}, "dropout_p must be in [0.0, 1.0]"),
]


@pytest.mark.parametrize(
    ("args", "kwargs", "phrase"), [r[1:] for r in SDPA_ROWS], ids=[r[0] for r in SDPA_ROWS]
)
def test_scaled_dot_product_attention_inputs(args, kwargs, phrase):
    raises(lambda: scaled_dot_product_attention(*args, **kwargs), ValueError, phrase)


# --- Decoding and BLEU ---------------------------------------------------------------------------

SPECIAL = {"bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID}
DECODE_ROWS = [
    (
        "beam 0",
        lambda m: beam_search(m, SRC, beam_size=0, max_len=5, **SPECIAL),
        ValueError,
        "beam_size must be at least 1, got 0",
    ),
    (
        "beam -2",
        lambda m: beam_search(m, SRC, beam_size=-2, max_len=5, **SPECIAL),
        ValueError,
        "beam_size must be at least 1, got -2",
    ),
    (
        "beam 2.5",
        lambda m: beam_search(m, SRC, beam_size=2.5, max_len=5, **SPECIAL),
        TypeError,
        "beam_size must be an int",
    ),
    (
        "beam max_len 0",
        lambda m: beam_search(m, SRC, beam_size=2, max_len=0, **SPECIAL),
        ValueError,
        "max_len must be at least 1, got 0",
    ),
    (
        "negative alpha",
        lambda m: beam_search(m, SRC, beam_size=2, max_len=5, alpha=-1.0, **SPECIAL),
        ValueError,
        "alpha must be at least 0.0",
    ),
    (
        "greedy max_len 0",
        lambda m: greedy_decode(m, SRC, max_len=0, **SPECIAL),
        ValueError,
        "max_len must be at least 1, got 0",
    ),
    (
        "greedy min_len -1",
        lambda m: greedy_decode(m, SRC, max_len=3, min_len=-1, **SPECIAL),
        ValueError,
        "min_len must be at least 0",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "phrase"), [r[1:] for r in DECODE_ROWS], ids=[r[0] for r in DECODE_ROWS]
)
def test_decoding_arguments(tiny_model, call, error, phrase):
    model = tiny_model(src_vocab_size=13, tgt_vocab_size=13)
    raises(lambda: call(model), error, phrase)


TRANSLATE_ROWS = [
    ("a str", "Ein Satz", {}, TypeError, "sentences must be a list of sentences, got one str"),
    ("not a list", 42, {}, TypeError, "sentences must be a list of str, got int"),
    ("a non-str item", ["Ein Satz", 3], {}, TypeError, "sentences[1] must be a str, got int"),
    ("beam 0", ["Ein Satz"], {"beam_size": 0}, ValueError, "beam_size must be at least 1"),
    (
        "max_len 0",
        ["Ein Satz"],
        {"max_len": 0},
        ValueError,
        "max_len=0 must be between 1 and the model's max_len=24",
    ),
    ("max_tokens 0", ["Ein Satz"], {"max_tokens": 0}, ValueError, "max_tokens must be at least 1"),
    ("empty", ["Ein Satz", ""], {}, ValueError, "sentence 2 is empty"),
    ("too long", [" ".join(["Hund"] * 40)], {}, ValueError, "more than the model's max_len=24"),
]


@pytest.mark.parametrize(
    ("sentences", "kwargs", "error", "phrase"),
    [r[1:] for r in TRANSLATE_ROWS],
    ids=[r[0] for r in TRANSLATE_ROWS],
)
def test_translate_sentences_arguments(tiny_checkpoint, sentences, kwargs, error, phrase):
    model, tokenizer, _ = load_model(tiny_checkpoint)
    raises(lambda: translate_sentences(model, tokenizer, sentences, **kwargs), error, phrase)


@pytest.mark.parametrize(
    ("hyps", "refs", "error", "phrase"),
    [
        ([], [], ValueError, "bleu needs at least one hypothesis"),
        (["a b"], ["a b", "c"], ValueError, "1 hypotheses but 2 references"),
        ("a b", ["a b"], TypeError, "hyps must be a list of sentences, got one str"),
        (["a b"], [None], TypeError, "refs[0] must be a str"),
    ],
    ids=str,
)
def test_bleu_arguments(hyps, refs, error, phrase):
    raises(lambda: bleu(hyps, refs), error, phrase)


# --- Files: corpus folder, tokenizer, checkpoints ------------------------------------------------


def test_a_multi30k_dir_that_does_not_exist_is_an_error_not_created(tmp_path, monkeypatch):
    missing = tmp_path / "typo"
    monkeypatch.setenv("MULTI30K_DIR", str(missing))
    raises(data_dir, DatasetUnavailableError, f"MULTI30K_DIR={missing} is not a folder")
    assert not missing.exists()


@pytest.mark.parametrize(
    ("content", "phrase"),
    [(None, "tokenizer not found"), (b"{", "cannot read the tokenizer"), (b"", "cannot read")],
    ids=["missing", "corrupt", "empty"],
)
def test_unreadable_tokenizer(tmp_path, content, phrase):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    raises(lambda: load_tokenizer(path), ValueError, phrase)


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        (None, "checkpoint not found"),
        (b"", "not a checkpoint written by transformer_tutorial.train (EOFError)"),
        (os.urandom(200), "not a checkpoint written by transformer_tutorial.train"),
        ("tensor", "(no model or model_config)"),
    ],
    ids=["missing", "empty", "random bytes", "not a checkpoint dict"],
)
def test_unreadable_checkpoint(tmp_path, content, phrase):
    path = tmp_path / "model.pt"
    if content == "tensor":
        torch.save(torch.zeros(3), path)
    elif content is not None:
        path.write_bytes(content)
    raises(lambda: load_model(path), CheckpointError, phrase)


# --- Training recipes and options ---------------------------------------------------------------

TRAIN_CONFIG_ROWS = [
    ({"epochs": 0}, ValueError, "epochs must be at least 1, got 0"),
    ({"beam_size": 0}, ValueError, "beam_size must be at least 1, got 0"),
    ({"max_tokens": -5}, ValueError, "max_tokens must be at least 1"),
    ({"warmup": 0}, ValueError, "warmup must be at least 1"),
    ({"lr": 0.0}, ValueError, "lr must be greater than 0.0"),
    ({"label_smoothing": 1.0}, ValueError, "label_smoothing must be in [0.0, 1.0)"),
    ({"clip_norm": -1.0}, ValueError, "clip_norm must be greater than 0.0"),
    ({"eval_every": -1}, ValueError, "eval_every must be at least 0"),
    ({"eval_size": 0}, ValueError, "eval_size must be at least 1"),
    ({"alpha": -0.5}, ValueError, "alpha must be at least 0.0"),
    ({"model": {"d_model": 8}}, TypeError, "model must be a TransformerConfig, got dict"),
]


@pytest.mark.parametrize(("changes", "error", "phrase"), TRAIN_CONFIG_ROWS, ids=str)
def test_train_config(changes, error, phrase):
    raises(lambda: replace(CONFIGS["tiny"], **changes), error, phrase)


@pytest.mark.parametrize(
    ("changes", "error", "phrase"),
    [
        ({"max_steps": 0}, ValueError, "max_steps must be at least 1, got 0"),
        ({"max_minutes": 0.0}, ValueError, "max_minutes must be greater than 0.0"),
        ({"seed": -1}, ValueError, "seed must be at least 0"),
        ({"device": "bogus"}, ValueError, "device 'bogus' is not a device name"),
    ],
    ids=str,
)
def test_run_options(changes, error, phrase):
    raises(lambda: RunOptions(**changes), error, phrase)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_an_absent_device_names_the_devices_there_are():
    raises(lambda: get_device("cuda"), ValueError, "not available here; this machine has ['cpu']")


# --- The command lines: one line, exit 1, no traceback ------------------------------------------

TRAIN_CLI_ROWS = [
    (["--max-steps", "0"], "--max-steps must be at least 1, got 0"),
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--beam", "0"], "--beam must be at least 1, got 0"),
    (["--eval-size", "0"], "--eval-size must be at least 1, got 0"),
    (["--max-minutes", "-1"], "--max-minutes must be greater than 0.0"),
    (["--threads", "-1"], "--threads must be at least 1, got -1"),
    (["--device", "bogus"], "device 'bogus' is not a device name"),
    (["--resume"], "--resume: no checkpoint"),
]


@pytest.mark.parametrize(("argv", "phrase"), TRAIN_CLI_ROWS, ids=lambda a: " ".join(a))
def test_train_cli_rejects_before_training(tmp_path, capsys, monkeypatch, argv, phrase):
    started = []
    monkeypatch.setattr(train_cli, "run_experiment", lambda *a, **k: started.append(1))
    code = train_cli.main(["--config", "tiny", "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 1 and not started
    assert err.count("\n") == 1 and err.startswith("error: ") and phrase in err, err


def test_train_cli_rejects_a_file_as_out_and_a_corrupt_last_checkpoint(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert train_cli.main(["--config", "tiny", "--out", str(a_file)]) == 1
    assert f"--out {a_file} is a file" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(os.urandom(100))
    assert train_cli.main(["--config", "tiny", "--out", str(tmp_path / "run"), "--resume"]) == 1
    assert "not a checkpoint written by transformer_tutorial.train" in capsys.readouterr().err


def run_translate(argv: list[str], stdin: bytes | None = None) -> tuple[int, str, str]:
    return_code, out, err = 0, io.StringIO(), io.StringIO()
    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8")
    sys.stdout, sys.stderr = out, err
    try:
        return_code = translate_cli.main(argv)
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
    return return_code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("argv", "stdin", "phrase"),
    [
        (["--beam", "0", "Ein Hund."], None, "--beam must be at least 1, got 0"),
        (["--max-len", "0", "Ein Hund."], None, "--max-len must be at least 1, got 0"),
        (["--alpha", "-1", "Ein Hund."], None, "--alpha must be at least 0, got -1.0"),
        (["--device", "bogus", "Ein Hund."], None, "--device: device 'bogus'"),
        ([], b"Ein \xff Hund\n", "standard input is not UTF-8 text (byte 0xff at offset 4)"),
        ([], b"", "no text: pass German sentences"),
        ([], b"Ein Hund.\n\nEine Katze.\n", "line 2 is empty"),
        (["--max-len", "99", "Ein Hund."], None, "max_len=99 must be between 1 and the model's"),
    ],
    ids=str,
)
def test_translate_cli_bad_arguments_and_input(tiny_checkpoint, argv, stdin, phrase):
    code, out, err = run_translate(["--checkpoint", str(tiny_checkpoint), *argv], stdin)
    assert code == 1 and not out
    assert err.count("\n") == 1 and err.startswith("error: ") and phrase in err, err


@pytest.mark.parametrize("damage", ["missing", "empty", "random", "no tokenizer", "bad tokenizer"])
def test_translate_cli_unreadable_files(tiny_checkpoint, tmp_path, damage):
    folder = tmp_path / "run"
    folder.mkdir()
    checkpoint = folder / "best.pt"
    tokenizer = folder / "tokenizer.json"
    checkpoint.write_bytes(tiny_checkpoint.read_bytes())
    tokenizer.write_bytes((tiny_checkpoint.parent / "tokenizer.json").read_bytes())
    phrase = {
        "missing": "checkpoint not found",
        "empty": "(EOFError)",
        "random": "not a checkpoint written",
        "no tokenizer": "tokenizer not found",
        "bad tokenizer": "cannot read the tokenizer",
    }[damage]
    if damage == "missing":
        checkpoint.unlink()
    elif damage == "empty":
        checkpoint.write_bytes(b"")
    elif damage == "random":
        checkpoint.write_bytes(os.urandom(300))
    elif damage == "no tokenizer":
        tokenizer.unlink()
    else:
        tokenizer.write_text("{ not json")
    code, out, err = run_translate(["--checkpoint", str(checkpoint), "Ein Hund."])
    assert code == 1 and not out and phrase in err and err.count("\n") == 1, err


def test_cli_errors_show_no_traceback_in_a_real_process(tmp_path):
    """The in-process tests above see main()'s return value; this one sees what a user sees."""
    command = [
        sys.executable,
        "-m",
        "transformer_tutorial.train",
        "--config",
        "tiny",
        "--out",
        str(tmp_path / "run"),
        "--beam",
        "0",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: --beam must be at least 1, got 0"
    assert not (tmp_path / "run").exists()


# --- Interruption: Ctrl-C or SIGTERM lose nothing ------------------------------------------------

INTERRUPT_CONFIG = replace(
    CONFIGS["tiny"], max_tokens=60, epochs=3, log_every=2, eval_every=0, checkpoint_every=0
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_saves_its_step_and_resumes_exactly(
    digit_reversal, tmp_path, monkeypatch, sig
):
    pairs = digit_reversal.pairs(48, seed=1), digit_reversal.pairs(12, seed=2)

    def train(out_dir: Path, **options):
        return fit(
            INTERRUPT_CONFIG,
            *pairs,
            vocab_size=13,
            out_dir=out_dir,
            options=RunOptions(seed=3, progress=False, **options),
        )

    straight, _ = train(tmp_path / "straight", max_steps=12)
    step = Trainer.train_step

    def step_then_signal(self, batch):
        result = step(self, batch)
        if self.state.step == 4:  # the signal arrives during the fifth step
            os.kill(os.getpid(), sig)
        return result

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    with pytest.raises(TrainingInterrupted) as info:
        train(tmp_path / "resumed", max_steps=12)
    monkeypatch.undo()
    assert info.value.step == 5 and info.value.checkpoint == tmp_path / "resumed" / "last.pt"
    assert torch.load(info.value.checkpoint, weights_only=True)["step"] == 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    resumed, state = train(tmp_path / "resumed", max_steps=12, resume=True)
    assert state.step == 12
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.corpus
def test_train_cli_ctrl_c_saves_prints_how_to_resume_and_resume_works(multi30k_dir, tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "transformer_tutorial.train",
        "--config",
        "tiny",
        "--out",
        str(out),
        "--epochs",
        "50",
        "--no-progress",
        "--threads",
        "1",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # the first checkpoint: training is under way
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err
    assert "interrupted after step" in err and f"--out {out} --resume" in err
    step = torch.load(out / "last.pt", weights_only=True)["step"]
    assert f"after step {step}:" in err
    resume = [
        sys.executable,
        "-m",
        "transformer_tutorial.train",
        "--config",
        "tiny",
        "--out",
        str(out),
        "--resume",
        "--max-steps",
        str(step + 2),
        "--no-progress",
    ]
    done = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{step + 2} steps" in done.stdout
