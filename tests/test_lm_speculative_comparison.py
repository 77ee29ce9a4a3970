"""speculative_comparison: the target is larger than the draft and shares its vocabulary; the
shipped record holds both runs and the measured decoding, whose greedy tokens were checked;
bad names are refused."""

from __future__ import annotations

from helpers import raises
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.speculative_comparison import (
    KS,
    comparison_config,
    load_comparison_record,
)


def test_the_target_is_four_times_the_draft():
    target, draft = (LanguageModel(comparison_config(n, 2000)) for n in ("target", "draft"))
    assert target.config.vocab_size == draft.config.vocab_size
    assert target.num_parameters() > 4 * draft.num_parameters()


def test_the_shipped_record_holds_both_runs_and_the_measurement():
    record = load_comparison_record()
    assert set(record["runs"]) == {"target", "draft"}
    decoding = record["decoding"]
    for k in KS:
        measured = decoding[f"k={k}"]
        assert 0 < measured["acceptance_rate"] < 1
        assert measured["target_calls"] < decoding["tokens"]
        assert measured["speed_up"] == decoding["seconds_alone"] / measured["seconds"]


def test_bad_names_are_refused():
    raises(lambda: comparison_config("huge", 10), ValueError, "name must be one of")
