"""Chapter 10's recipes: one registry that the CLI, the chapters and the benchmark read; each
recipe builds its model and is frozen; and bad inputs: every field of a TrainConfig refuses
nonsense with a message that says what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import raises
from transformer_tutorial.configs import CONFIGS, TrainConfig
from transformer_tutorial.model import Transformer
from transformer_tutorial.optim import paper_peak_lr


def parameters(config: TrainConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(config.model).parameters())


def test_each_recipe_is_filed_under_its_own_name_and_builds_a_translator():
    for name, config in CONFIGS.items():
        assert config.name == name
        with torch.device("meta"):
            model = Transformer(config.model)
        # One joint vocabulary: shared source/target embeddings, tied to the output layer.
        assert model.src_embed.weight is model.tgt_embed.weight is model.generator.weight
        assert config.vocab_size == config.model.src_vocab_size == config.model.tgt_vocab_size


def test_recipes_grow_from_tests_to_the_papers_base_model():
    sizes = [parameters(CONFIGS[name]) for name in ("tiny", "chapter10", "small", "base")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4


def test_base_follows_the_papers_learning_rate_schedule():
    base = CONFIGS["base"]
    assert base.lr == pytest.approx(paper_peak_lr(base.model.d_model, base.warmup))
    assert not base.model.norm_first  # the paper's post-norm


def test_chapter10_is_a_reduced_small_with_the_same_loss_and_search():
    chapter, small = CONFIGS["chapter10"], CONFIGS["small"]
    assert parameters(chapter) < parameters(small)
    assert chapter.vocab_size < small.vocab_size  # its output layer would dominate at d_model 128
    same = ("label_smoothing", "clip_norm", "beam_size", "alpha")
    assert [getattr(chapter, k) for k in same] == [getattr(small, k) for k in same]
    assert chapter.model.norm_first == small.model.norm_first
    assert chapter.train_size is None  # the whole training set; the time budget bounds the run


def test_model_config_fits_the_vocabulary_bpe_learned():
    """BPE may learn fewer tokens than asked: the model is built for the tokenizer's size."""
    small = CONFIGS["small"]
    model = small.model_config(7_123)
    assert (model.src_vocab_size, model.tgt_vocab_size) == (7_123, 7_123)
    assert dataclasses.replace(model, src_vocab_size=8_000, tgt_vocab_size=8_000) == small.model


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CONFIGS["tiny"].lr = 1.0


# --- bad inputs: every field of a TrainConfig ---------------------------------------------------

TRAIN_CONFIG_ROWS = [
    ({"epochs": 0}, ValueError, "epochs must be at least 1, got 0"),
    ({"beam_size": 0}, ValueError, "beam_size must be at least 1, got 0"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be at least 1, got 0"),
    ({"max_tokens": -5}, ValueError, "max_tokens must be at least 1"),
    ({"warmup": 0}, ValueError, "warmup must be at least 1"),
    ({"lr": 0.0}, ValueError, "lr must be greater than 0.0"),
    ({"label_smoothing": 1.0}, ValueError, "label_smoothing must be in [0.0, 1.0)"),
    ({"clip_norm": -1.0}, ValueError, "clip_norm must be greater than 0.0"),
    ({"eval_every": -1}, ValueError, "eval_every must be at least 0"),
    ({"eval_size": 0}, ValueError, "eval_size must be at least 1"),
    ({"alpha": -0.5}, ValueError, "alpha must be at least 0.0"),
    ({"average_last": 0}, ValueError, "average_last must be at least 1, got 0"),
    ({"steps": 0}, ValueError, "steps must be at least 1, got 0"),
    ({"warmup": 20, "steps": 20}, ValueError, "steps=20 must be more than warmup=20"),
    (
        {"average_last": 3, "checkpoint_every": 0},
        ValueError,
        "average_last=3 averages checkpoints, so checkpoint_every must be at least 1",
    ),
    ({"model": {"d_model": 8}}, TypeError, "model must be a TransformerConfig, got dict"),
]


@pytest.mark.parametrize(("changes", "error", "phrase"), TRAIN_CONFIG_ROWS, ids=str)
def test_train_config_refuses_bad_fields(changes, error, phrase):
    raises(lambda: dataclasses.replace(CONFIGS["tiny"], **changes), error, phrase)
