"""Figures shared by the chapters: one look for every heatmap and curve in the book.

Nothing in the model imports this module; only notebooks do.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import seaborn as sns
import torch


def use_book_style() -> None:
    """Seaborn's clean theme, readable font sizes, crisp PNGs with a white background (legible
    in the website's dark mode too)."""
    sns.set_theme(context="notebook", style="whitegrid", palette="deep")
    plt.rcParams.update(
        {
            "figure.dpi": 110,
            "savefig.dpi": 110,
            "figure.facecolor": "white",
            "savefig.facecolor": "white",
            "axes.titleweight": "bold",
            "figure.autolayout": True,
        }
    )


def heatmap(
    matrix: torch.Tensor,
    *,
    ax: plt.Axes | None = None,
    x_labels: Sequence[str] | None = None,
    y_labels: Sequence[str] | None = None,
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    cmap: str = "viridis",
    annot: bool = False,
    fmt: str = ".2f",
    vmin: float | None = None,
    vmax: float | None = None,
    cbar: bool = True,
    center: float | None = None,
    annot_kws: dict | None = None,
) -> plt.Axes:
    """Draw a 2-D tensor (rows × columns) as a seaborn heatmap with optional token labels.

    ``annot_kws`` goes to seaborn with ``annot=True``: ``{"fontsize": 11}`` sizes the numbers."""
    matrix = matrix.detach().cpu()
    # ints stay ints
    data = (matrix.float() if matrix.is_floating_point() else matrix.long()).numpy()
    if data.ndim != 2:
        raise ValueError(f"heatmap takes a 2-D tensor, got shape {tuple(matrix.shape)}")
    if ax is None:
        width = max(3.0, 0.45 * data.shape[1] + 1.5)
        _, ax = plt.subplots(figsize=(width, max(2.5, 0.4 * data.shape[0] + 1.0)))
    sns.heatmap(
        data,
        ax=ax,
        cmap=cmap,
        annot=annot,
        fmt=fmt,
        annot_kws=annot_kws,
        vmin=vmin,
        vmax=vmax,
        cbar=cbar,
        center=center,
        xticklabels=list(x_labels) if x_labels is not None else "auto",
        yticklabels=list(y_labels) if y_labels is not None else "auto",
        square=False,
        linewidths=0.0,
    )
    if x_labels is not None:
        ax.set_xticklabels(ax.get_xticklabels(), rotation=60, ha="right")
    if y_labels is not None:
        ax.set_yticklabels(ax.get_yticklabels(), rotation=0)
    if title:
        ax.set_title(title)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    return ax
