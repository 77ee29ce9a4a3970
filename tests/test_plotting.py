"""plotting: heatmaps draw the matrix they are given, labelled, and refuse what is not 2-D."""

from __future__ import annotations

import matplotlib
import pytest
import torch

from transformer_tutorial.plotting import heatmap

matplotlib.use("Agg")


def test_heatmap_draws_the_matrix_with_its_labels():
    import matplotlib.pyplot as plt

    weights = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.25, 0.25]], requires_grad=True)
    ax = heatmap(weights, x_labels=["a", "b", "c"], y_labels=["x", "y"], title="t", annot=True)
    drawn = ax.collections[0].get_array().flatten().tolist()
    assert drawn == pytest.approx(weights.flatten().tolist())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y"]
    assert ax.get_title() == "t"
    assert sorted(t.get_text() for t in ax.texts) == sorted(
        f"{v:.2f}" for v in weights.flatten().tolist()
    )
    plt.close("all")


def test_heatmap_of_integers_annotates_integers():
    import matplotlib.pyplot as plt

    ax = heatmap(torch.tensor([[1, 0], [0, 1]]), annot=True, fmt="d")
    assert sorted(t.get_text() for t in ax.texts) == ["0", "0", "1", "1"]
    plt.close("all")


def test_heatmap_refuses_what_is_not_a_matrix():
    with pytest.raises(ValueError, match=r"2-D tensor, got shape \(2, 2, 2\)"):
        heatmap(torch.zeros(2, 2, 2))
