"""Chapter 20: a mixture of experts, a feed-forward layer of which each token runs only a part.

A router scores every expert for each token and keeps the ``k`` best (:func:`route`); the
experts, SwiGLU layers stored as stacked matrices (:class:`Experts`), run on the tokens grouped
by expert, and each token's ``k`` outputs are summed with the router's weights
(:class:`MixtureOfExperts`, Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``). Every token reaches
all ``k`` of its experts, however many choose the same one: no capacity, no token dropped.
The auxiliary load-balancing loss (GShard's form, scaled as the Switch Transformer scales it)
comes two ways: :func:`load_balancing_loss` pools every sparse layer's tokens, as
``transformers`` computes it for Qwen3-MoE; :func:`load_balancing_loss_per_layer` gives one
loss per layer, as the papers add it.

Shapes: ``N`` tokens (``B · T`` flattened), ``D`` d_model, ``E`` experts, ``k`` experts per
token, ``F`` an expert's hidden width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.checks import check_bool, check_int, check_number


def check_experts(n_experts: object, top_k: object, *, top_k_name: str = "top_k") -> None:
    """An error naming the argument unless ``1 <= top_k <= n_experts``."""
    check_int("n_experts", n_experts, at_least=1)
    check_int(top_k_name, top_k, at_least=1)
    if top_k > n_experts:
        raise ValueError(
            f"{top_k_name}={top_k} exceeds n_experts={n_experts}: a token picks at most "
            "every expert"
        )


def route(router_logits: Tensor, top_k: int, *, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """Each token's ``top_k`` experts and their weights, from the router's logits.

    A softmax over the experts (in float32), the ``top_k`` largest probabilities (ties go where
    ``torch.topk`` puts them), and with ``norm_topk_prob`` those ``top_k`` divided by their sum
    so that they add up to 1 (Qwen3-30B-A3B; Qwen3-MoE's default and Switch keep them as they
    are).

    Shapes:
        router_logits ``(N, E)`` → weights ``(N, k)`` in the logits' dtype and expert ids
        ``(N, k)``, each row in decreasing weight.
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # (N, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (N, k) each
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class Experts(nn.Module):
    """``E`` SwiGLU layers (chapter 14's), each ``down_proj(silu(gate_proj x) * up_proj x)``,
    their matrices stacked: ``gate_proj`` and ``up_proj`` ``(E, F, D)``, ``down_proj``
    ``(E, D, F)``, no biases (the per-expert matrices of a Qwen3-MoE checkpoint, stacked).

    ``forward`` runs every token through the experts chosen for it, grouped by expert: the
    ``(token, choice)`` pairs are sorted by expert id, so each expert reads one contiguous
    block of tokens and runs as three matrix products; the weighted outputs are added back to
    their tokens with ``index_add_``. The loop goes over experts, never over tokens.

    Shapes:
        x ``(N, D)``, experts and weights ``(N, k)`` → ``(N, D)``.
    """

    # What writes into the residual stream: a language model initialises it smaller.
    residual_projections = ("down_proj",)

    def __init__(self, n_experts: int, d_model: int, d_ff: int, *, dropout: float = 0.0):
        super().__init__()
        check_int("n_experts", n_experts, at_least=1)
        check_int("d_model", d_model, at_least=1)
        check_int("d_ff", d_ff, at_least=1)
        check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
        self.n_experts = n_experts
        self.gate_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.up_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.dropout = nn.Dropout(dropout)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        k = experts.size(1)
        # 1) group: the (token, choice) pairs in order of expert id, then of token
        chosen = experts.flatten()  # (N·k,)
        order = chosen.argsort(stable=True)  # (N·k,)
        tokens = order // k  # the token of each sorted pair
        counts = torch.bincount(chosen, minlength=self.n_experts).tolist()  # one read back
        # 2) each expert on its block of tokens (an empty block stays empty); unbind, not
        # gate_proj[e]: indexing each expert would give each its own full-size gradient
        blocks = x[tokens].split(counts)  # E blocks (n_e, D)
        each = zip(
            blocks,
            self.gate_proj.unbind(),
            self.up_proj.unbind(),
            self.down_proj.unbind(),
            strict=True,
        )
        out = torch.cat([self._expert(*e) if len(e[0]) else e[0] for e in each])  # (N·k, D)
        # 3) weight each output and add it to its token
        out = out * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))

    def _expert(self, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
        """One expert's SwiGLU on its ``n`` tokens: ``(n, D)`` → ``(n, D)``."""
        gated = F.silu(F.linear(x, gate)) * F.linear(x, up)  # (n, F)
        return F.linear(self.dropout(gated), down)


class MixtureOfExperts(nn.Module):
    """A sparse feed-forward layer: a router (a linear map ``D → E``, no bias) picks each
    token's ``top_k`` experts (:func:`route`) and the token's output is the weighted sum of
    theirs (:class:`Experts`). ``forward`` returns the output, as every feed-forward layer;
    :meth:`forward_with_router_logits` also returns the router's logits, which the
    load-balancing loss reads.

    Args:
        d_model: D.
        d_ff: F, each expert's hidden width (Qwen3-MoE's ``moe_intermediate_size``).
        n_experts: E.
        top_k: experts per token, 1 to E (``num_experts_per_tok``).
        norm_topk_prob: renormalise the ``top_k`` weights to sum to 1.
        dropout: on each expert's gated product, as chapter 14's SwiGLU.

    Shapes:
        x ``(..., D)`` → ``(..., D)``; router logits ``(N, E)``, ``N`` the positions of ``x``.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        check_experts(n_experts, top_k)
        check_bool("norm_topk_prob", norm_topk_prob)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, d_ff, dropout=dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_with_router_logits(x)[0]

    def forward_with_router_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``(..., D)`` → the output ``(..., D)`` and the router's logits ``(N, E)``."""
        flat = x.reshape(-1, x.size(-1))  # (N, D)
        logits = self.router(flat)  # (N, E)
        weights, experts = route(logits, self.top_k, norm_topk_prob=self.norm_topk_prob)
        return self.experts(flat, experts, weights).view(x.shape), logits


def load_balancing_loss(
    router_logits: Sequence[Tensor], top_k: int, *, padding_mask: Tensor | None = None
) -> Tensor:
    """The auxiliary loss ``E · Σ_e f_e · P_e`` as ``transformers``' ``load_balancing_loss_func``
    computes it for Qwen3-MoE: the logits of every sparse layer pooled into one set of rows.

    ``f_e`` is the number of ``top_k`` choices that went to expert ``e`` per token, ``P_e`` the
    router's mean probability of ``e``; padding (``padding_mask`` True) counts in neither.
    Pooling lets one layer's imbalance cancel another's (the papers add one loss per layer:
    :func:`load_balancing_loss_per_layer`). The loss is ``k`` whenever the counts or the
    probabilities are even, and at most ``E``; it has no floor at ``k``: uneven counts whose
    probability is parked on idle experts score below it. The softmax runs in float32, as the
    router's does; ``transformers`` softmaxes bf16 logits in bf16, so the two are equal in
    float32, and in bf16 ours is the nearer to float64.

    Shapes:
        router_logits: one ``(N, E)`` per sparse layer, ``N = B · T``; padding_mask ``(B, T)``.
    """
    if not router_logits:
        raise ValueError("router_logits is empty: the model has no mixture-of-experts layer")
    logits = torch.cat(list(router_logits))  # (L·N, E)
    n_layers, (rows, n_experts) = len(router_logits), router_logits[0].shape
    check_experts(n_experts, top_k)
    probs = F.softmax(logits.float(), dim=-1)  # (L·N, E)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # (L·N, k)
    if padding_mask is None:
        real = probs.new_ones(n_layers * rows)
    else:
        if (
            padding_mask.dtype != torch.bool
            or padding_mask.dim() != 2
            or padding_mask.numel() != rows
        ):
            raise ValueError(
                f"padding_mask must be a bool (B, T) with B·T = {rows}, the router logits' rows "
                f"(True at padding), got {padding_mask.dtype} {tuple(padding_mask.shape)}"
            )
        real = (~padding_mask).flatten().float().repeat(n_layers)  # (L·N,)
    counted = real.sum()
    f = probs.new_zeros(n_experts).index_add_(0, chosen.flatten(), real.repeat_interleave(top_k))
    p = (probs * real[:, None]).sum(0)
    return n_experts * (f / counted * p / counted).sum()


def load_balancing_loss_per_layer(
    router_logits: Sequence[Tensor], top_k: int, *, padding_mask: Tensor | None = None
) -> Tensor:
    """The auxiliary loss of each sparse layer on its own, as the Switch Transformer and
    GShard add it ("for each Switch layer"): :func:`load_balancing_loss` of one layer's
    logits, for each layer. The caller adds them to the training loss (times ``α``); a layer
    that has collapsed scores up to ``E`` whatever the other layers do.

    Shapes:
        router_logits: one ``(N, E)`` per sparse layer; padding_mask ``(B, T)``, ``B·T = N``
        → losses ``(L,)``.
    """
    if not router_logits:
        raise ValueError("router_logits is empty: the model has no mixture-of-experts layer")
    return torch.stack(
        [
            load_balancing_loss((logits,), top_k, padding_mask=padding_mask)
            for logits in router_logits
        ]
    )


def tokens_per_expert(
    router_logits: Sequence[Tensor], top_k: int, *, padding_mask: Tensor | None = None
) -> Tensor:
    """How many tokens each layer sends to each expert (padding not counted).

    Shapes:
        router_logits: one ``(N, E)`` per sparse layer; padding_mask ``(B, T)``, ``B·T = N``
        → counts ``(L, E)``, each row summing to ``k`` × the real tokens.
    """
    counts = []
    for logits in router_logits:
        _, chosen = route(logits, top_k, norm_topk_prob=False)  # (N, k)
        if padding_mask is not None:
            chosen = chosen[~padding_mask.flatten()]
        counts.append(torch.bincount(chosen.flatten(), minlength=logits.size(-1)))
    return torch.stack(counts)
