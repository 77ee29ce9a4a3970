"""Chapter 26's experiment: training to a FLOP budget, batched translation, the baseline's
FLOPs counted on the meta device, and the shipped record."""

import json
from pathlib import Path

import pytest
import torch

from transformer_tutorial import data
from transformer_tutorial.flops import count_flops
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.tuning.chat import add_chat_tokens, apply_chat_template, translation_chat
from transformer_tutorial.tuning.sft import SFTBatch, pack_examples, pad_examples, sft_loss
from transformer_tutorial.tuning.sft_run import (
    RECORD_FILES,
    ROW_LEN,
    ROWS,
    load_sft_record,
    sft_config,
    train_to_budget,
    training_loss,
    translate,
)

PAIRS = [
    ("Ein Hund läuft.", "A dog runs."),
    ("Zwei Männer spielen.", "Two men play."),
    ("Ein Mann läuft.", "A man runs."),
    ("Zwei Hunde spielen.", "Two dogs play."),
] * 12


@pytest.fixture(scope="module")
def setup():
    tokenizer = data.train_tokenizer([s for pair in PAIRS for s in pair], vocab_size=120)
    add_chat_tokens(tokenizer)
    examples = [apply_chat_template(tokenizer, translation_chat(de, en)) for de, en in PAIRS]
    return tokenizer, examples


def test_training_loss_is_the_masked_loss(setup):
    tokenizer, examples = setup
    torch.manual_seed(0)
    model = LanguageModel(sft_config(tokenizer.get_vocab_size())).double().eval()
    packed = pack_examples(examples, ROW_LEN)
    padded = pad_examples(examples)
    torch.testing.assert_close(
        training_loss(model, packed).double(),
        sft_loss(model(padded.ids), padded.labels),
        rtol=0,
        atol=1e-12,
    )


def test_trains_to_the_flop_budget_and_learns(setup):
    tokenizer, examples = setup
    torch.manual_seed(0)
    model = LanguageModel(sft_config(tokenizer.get_vocab_size()))
    rows = pack_examples(examples, 48)
    assert rows.ids.size(0) >= ROWS
    step = SFTBatch(rows.ids[:ROWS], rows.labels[:ROWS], rows.position_ids[:ROWS], ())
    one_step = count_flops(lambda: training_loss(model, step).backward())
    model.zero_grad()
    result = train_to_budget(model, rows, flops=30 * one_step, lr=3e-3, warmup=5, log_every=5)
    assert result["stopped_by"] == "flops" and result["flops"] >= 30 * one_step
    losses = [loss for _, _, loss in result["train"]]
    assert losses[-1] < losses[0] / 2
    # a budget of one step trains one step
    again = train_to_budget(model, rows, flops=1)
    assert again["steps"] == 1


def test_batched_translation_equals_one_at_a_time(setup):
    tokenizer, _ = setup
    torch.manual_seed(0)
    model = LanguageModel(sft_config(tokenizer.get_vocab_size())).eval()
    sources = [de for de, _ in PAIRS[:3]] + ["Hund"]
    batched = translate(model, tokenizer, sources)
    alone = [translate(model, tokenizer, [s], batch_size=1)[0] for s in sources]
    assert batched == alone and all(isinstance(h, str) for h in batched)


@pytest.mark.parametrize("budget, name", [(1, "record.json"), (4, "record_x4.json")])
def test_shipped_records_are_the_results_files(budget, name):
    shipped = load_sft_record(budget)
    results = Path(__file__).parents[1] / "results" / "sft_translation" / name
    assert shipped == json.loads(results.read_text())
    assert RECORD_FILES[budget].endswith(".json")
    ours, baseline = shipped, shipped["baseline"]
    # equal compute: stopped on the baseline's FLOPs, at most one step past them
    assert ours["stopped_by"] == "flops" and baseline["flops"] <= ours["flops"]
    assert ours["flops"] - baseline["flops"] < ours["flops"] / ours["steps"]
    assert baseline["steps"] == 600 * budget
    assert "--baseline" in ours["command"] and ours["test2016"]["sentences"] == 1000


def test_unknown_budget_is_refused():
    with pytest.raises(ValueError, match=r"budget must be one of \[1, 4\], got 2"):
        load_sft_record(2)
