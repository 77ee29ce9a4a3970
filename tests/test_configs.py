"""Chapter 10's recipes: one registry that the CLI, the chapters and the benchmark read; each
recipe builds its model, and a recipe refuses nonsense."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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


def test_chapter10_is_a_reduced_small_with_the_same_tokenizer_and_loss():
    chapter, small = CONFIGS["chapter10"], CONFIGS["small"]
    assert parameters(chapter) < parameters(small)
    same = ("vocab_size", "label_smoothing", "clip_norm", "beam_size", "alpha")
    assert [getattr(chapter, k) for k in same] == [getattr(small, k) for k in same]
    assert chapter.model.norm_first == small.model.norm_first
    assert chapter.train_size is None  # the whole training set; the time budget bounds the run


def test_model_config_fits_the_vocabulary_bpe_learned():
    """BPE may learn fewer tokens than asked: the model is built for the tokenizer's size."""
    small = CONFIGS["small"]
    model = small.model_config(7_123)
    assert (model.src_vocab_size, model.tgt_vocab_size) == (7_123, 7_123)
    assert dataclasses.replace(model, src_vocab_size=8_000, tgt_vocab_size=8_000) == small.model


def test_recipes_are_frozen_and_refuse_nonsense():
    tiny = CONFIGS["tiny"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.lr = 1.0
    with pytest.raises(TypeError, match="TransformerConfig"):
        TrainConfig("odd", model=dataclasses.asdict(tiny.model))
    for field, value in [("max_tokens", 0), ("lr", 0.0), ("label_smoothing", 1.0)]:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(tiny, **{field: value})
