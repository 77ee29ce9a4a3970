"""Section 4: beam 5 against greedy, sentences/s on test2016 with a trained model."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.cli import Settings
from bench.timing import timed_call
from transformer_tutorial.checkpoint import load_model
from transformer_tutorial.decode import translate_sentences
from transformer_tutorial.multi30k import load_split
from transformer_tutorial.precision import autocast
from transformer_tutorial.runs import find_checkpoint


def _skipped(reason: str) -> dict:
    print(f"  skipped: {reason}", flush=True)
    return {"skipped": reason}


def _test_sentences(model, tokenizer, count: int) -> list[str] | str:
    """The first ``count`` sentences of test2016 that fit the model's positions (all of them for
    a trained recipe), or the reason there are none."""
    try:
        test = load_split("test")[0]
    except Exception as err:  # no corpus here: skip rather than fail the whole benchmark
        return f"test2016 unavailable: {err}"
    fits = [len(e.ids) <= model.config.max_len for e in tokenizer.encode_batch(test)]
    sentences = [x for x, ok in zip(test, fits, strict=True) if ok][:count]
    if not sentences:
        return f"no test2016 sentence fits the model's max_len={model.config.max_len}"
    return sentences


def bench_beam(s: Settings, device: torch.device) -> dict:
    """Section 4: sentences/s of greedy and of beam 5, one pass each over the same sentences."""
    checkpoint: Path | None = s.checkpoint or find_checkpoint()
    if checkpoint is None:
        return _skipped("no trained checkpoint cached (runs.find_checkpoint() found none)")
    model, tokenizer, _ = load_model(checkpoint, device)
    if tokenizer is None:
        return _skipped(f"{checkpoint} has no tokenizer beside it")
    sentences = _test_sentences(model, tokenizer, s.beam_sentences)
    if isinstance(sentences, str):
        return _skipped(sentences)
    row = {"checkpoint": str(checkpoint), "sentences": len(sentences)}
    for beam in (1, 5):

        def translate(beam: int = beam) -> None:
            with autocast(s.precision, device):
                translate_sentences(model, tokenizer, sentences, beam_size=beam)

        row[f"beam{beam}_sentences_per_s"] = len(sentences) / timed_call(translate, device)
    row["beam5_over_greedy"] = row["beam5_sentences_per_s"] / row["beam1_sentences_per_s"]
    print(
        f"  {len(sentences)} sentences of test2016 ({checkpoint}): greedy "
        f"{row['beam1_sentences_per_s']:.1f}/s, beam 5 {row['beam5_sentences_per_s']:.1f}/s "
        f"(beam 5 ÷ greedy {row['beam5_over_greedy']:.2f})",
        flush=True,
    )
    return row
