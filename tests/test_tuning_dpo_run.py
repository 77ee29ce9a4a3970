"""tuning.dpo_run: batched translation equals one sentence at a time; the on-policy pairs hold
each sentence's best and worst sample by chrF, as prompt + completion ids, with ties dropped;
fine-tuning and DPO each move what they should; the shipped record is the committed one; the
command line refuses bad flags by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu
import torch

from helpers import raises
from transformer_tutorial import data
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.tuning import dpo_run
from transformer_tutorial.tuning.chat import (
    add_chat_tokens,
    apply_chat_template,
    chat_tokens,
    translation_chat,
)
from transformer_tutorial.tuning.sft import pad_examples, sft_loss

PAIRS = [
    ("Ein Hund läuft.", "A dog runs."),
    ("Zwei Männer spielen Fußball auf einer Wiese.", "Two men play soccer on a meadow."),
    ("Eine Frau liest.", "A woman reads."),
    ("Ein Kind springt in den See.", "A child jumps into the lake."),
]


@pytest.fixture(scope="module")
def tokenizer():
    sentences = [s for pair in PAIRS for s in pair] * 5
    tok = data.train_tokenizer(sentences, vocab_size=120)
    add_chat_tokens(tok)
    return tok


def small_model(tokenizer, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    sizes = dpo_run.SIZES | dict(d_model=32, n_heads=2, n_kv_heads=1, n_layers=1, d_ff=48)
    config = dpo_run.model_config(tokenizer)
    return LanguageModel(type(config)(vocab_size=config.vocab_size, dropout=0.0, **sizes)).eval()


def test_batched_translation_equals_one_at_a_time(tokenizer):
    model = small_model(tokenizer)
    germans = [de for de, _ in PAIRS]
    together = dpo_run.translate(model, tokenizer, germans)
    alone = [dpo_run.translate(model, tokenizer, [de])[0] for de in germans]
    assert together == alone
    end = chat_tokens(tokenizer).end
    for (completion,) in together:
        assert completion[-1] == end or len(completion) == dpo_run.MAX_NEW_TOKENS


def test_pairs_are_best_and_worst_by_chrf(tokenizer):
    model = small_model(tokenizer, seed=1)
    pairs = dpo_run.preference_pairs(model, tokenizer, PAIRS, samples=4, seed=3)
    samples = dpo_run.translate(
        model,
        tokenizer,
        [de for de, _ in PAIRS],
        samples=4,
        temperature=1.0,
        generator=torch.Generator().manual_seed(3),
    )
    k = 0
    for (de, en), candidates in zip(PAIRS, samples, strict=True):
        scores = [
            sacrebleu.sentence_chrf(dpo_run.text_of(tokenizer, c), [en]).score for c in candidates
        ]
        if max(scores) == min(scores):
            continue  # a tie gives no pair
        prompt, chosen, rejected = pairs.examples[k]
        assert prompt == dpo_run.prompt_ids(tokenizer, de)
        assert chosen in candidates and rejected in candidates
        assert pairs.chosen_chrf[k] == max(scores) and pairs.rejected_chrf[k] == min(scores)
        k += 1
    assert k == len(pairs.examples) > 0


def test_dpo_raises_the_margin_on_its_pairs(tokenizer):
    """DPO from the model itself: the margin starts at 0 and rises on the training pairs."""
    model = small_model(tokenizer, seed=2)
    pairs = dpo_run.preference_pairs(model, tokenizer, PAIRS * 4, samples=4, seed=0)
    refs = dpo_run.reference_logps(model, pairs.examples)
    before = dpo_run.reward_stats(model, pairs.examples, refs, beta=0.1)
    policy = LanguageModel(model.config)
    policy.load_state_dict(model.state_dict())
    dpo_run.dpo_train(policy, pairs.examples, refs, beta=0.1, steps=15, lr=1e-3)
    after = dpo_run.reward_stats(policy, pairs.examples, refs, beta=0.1)
    assert before.margin == 0.0
    assert after.margin > 0.1 and after.accuracy > 0.8


def test_fine_tune_lowers_the_loss(tokenizer):
    """Chapter 26's answer-only loss on the pairs, before and after 2 seconds of fine-tuning."""
    model = small_model(tokenizer, seed=3)
    batch = pad_examples(
        [apply_chat_template(tokenizer, translation_chat(de, en)) for de, en in PAIRS]
    )

    def loss() -> float:
        with torch.no_grad():
            return sft_loss(model(batch.ids), batch.labels).item()

    before = loss()
    done = dpo_run.fine_tune(model, tokenizer, PAIRS, seconds=2.0, lr=1e-2)
    assert done["steps"] >= 1 and done["examples"] == 4 * done["steps"]
    assert loss() < before - 0.5


def test_shipped_record_is_the_committed_one():
    results = Path(__file__).resolve().parents[1] / "results" / "dpo" / "record.json"
    shipped = dpo_run.load_dpo_record()
    assert shipped == json.loads(results.read_text())
    assert shipped["command"][:3] == ["python", "-m", "transformer_tutorial.tuning.dpo_run"]
    assert [run["beta"] for run in shipped["runs"]] == list(dpo_run.BETAS)
    for run in shipped["runs"]:  # DPO separates the pairs it trained on
        assert run["train_margin"] > 0 and run["train_accuracy"] > 0.5


def test_command_line_refuses_bad_flags(capsys):
    for flags, phrase in (
        (["--out", "x.json", "--sft-minutes", "0"], "--sft-minutes"),
        (["--out", "x.json", "--dpo-steps", "0"], "--dpo-steps"),
        (["--sft-minutes", "1"], "--out"),
    ):
        with pytest.raises(SystemExit) as info:
            dpo_run.main(flags)
        assert info.value.code == 2 and phrase in capsys.readouterr().err
    raises(lambda: dpo_run.preference_pairs(None, None, PAIRS, samples=1), ValueError, "samples")
