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

DeepSeek-V3's mixture (:class:`DeepSeekMoE`, ``transformers``' ``DeepseekV3MoE``) routes
otherwise (:func:`group_limited_route`): sigmoid scores, a correction bias that steers the choice
but not the weights, the experts chosen only from the best groups, the weights scaled; shared
experts run on every token. Its balance comes without a loss: after each step the bias moves
against each expert's load (:func:`update_correction_bias`).

Shapes: ``N`` tokens (``B · T`` flattened), ``D`` d_model, ``E`` experts, ``k`` experts per
token, ``F`` an expert's hidden width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.checks import (
    check_bool,
    check_int,
    check_number,
    check_optional_int,
    check_tensor,
    check_type,
)
from transformer_tutorial.feed_forward import SwiGLU
from transformer_tutorial.lm.registry import ROUTERS, Piece


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
    check_tensor("router_logits", router_logits, kind="float", dims=2, shape="(N, E)")
    check_experts(router_logits.size(-1), top_k)
    check_bool("norm_topk_prob", norm_topk_prob)
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # (N, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (N, k) each
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def check_groups(
    n_experts: object,
    top_k: object,
    n_group: object,
    topk_group: object,
    *,
    top_k_name: str = "top_k",
) -> None:
    """An error naming the argument unless DeepSeek-V3's groups fit: ``n_group`` divides the
    experts, ``1 <= topk_group <= n_group``, each group holds at least the 2 experts it is
    ranked by (with more than one group), and ``top_k`` fits in the chosen groups' experts."""
    check_experts(n_experts, top_k, top_k_name=top_k_name)
    check_int("n_group", n_group, at_least=1)
    check_int("topk_group", topk_group, at_least=1)
    if n_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_experts={n_experts}")
    if topk_group > n_group:
        raise ValueError(
            f"topk_group={topk_group} exceeds n_group={n_group}: choose 1 to {n_group}"
        )
    size = n_experts // n_group
    if n_group > 1 and size < 2:
        raise ValueError(
            f"n_group={n_group} leaves {size} expert per group: a group is ranked by its 2 best "
            f"scores, so n_group is at most n_experts // 2 = {n_experts // 2} (or 1)"
        )
    if top_k > topk_group * size:
        raise ValueError(
            f"{top_k_name}={top_k} exceeds the {topk_group * size} experts of topk_group="
            f"{topk_group} groups of {size}: raise topk_group or lower {top_k_name}"
        )


def group_limited_route(
    router_logits: Tensor,
    correction_bias: Tensor,
    top_k: int,
    *,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's routing (``transformers``' ``DeepseekV3TopkRouter``), in float32.

    Each expert's score is the sigmoid of its logit. The choice reads the scores plus
    ``correction_bias``: the experts are split into ``n_group`` groups, each group ranked by the
    sum of its 2 best biased scores, and a token picks its ``top_k`` experts by biased score
    among the experts of its ``topk_group`` best groups (ties go where ``torch.topk`` puts
    them). The weights are the chosen experts' scores without the bias, divided by their sum
    with ``norm_topk_prob``, times ``routed_scaling_factor``.

    Shapes:
        router_logits ``(N, E)``, correction_bias ``(E,)`` → weights ``(N, k)`` in float32 and
        expert ids ``(N, k)``, in no particular order.
    """
    check_tensor("router_logits", router_logits, kind="float", dims=2, shape="(N, E)")
    check_tensor("correction_bias", correction_bias, kind="float")
    N, E = router_logits.shape
    check_groups(E, top_k, n_group, topk_group)
    check_bool("norm_topk_prob", norm_topk_prob)
    check_number("routed_scaling_factor", routed_scaling_factor, low=0.0, low_open=True)
    if correction_bias.shape != (E,):
        raise ValueError(
            f"correction_bias must have shape ({E},), one per expert, got "
            f"{tuple(correction_bias.shape)}"
        )
    scores = router_logits.float().sigmoid()  # (N, E)
    biased = scores + correction_bias.float()  # (N, E): for choosing only
    if topk_group < n_group:  # (with every group kept, nothing to mask)
        # 1) rank the groups by the sum of their 2 best biased scores; keep topk_group of them
        grouped = biased.view(N, n_group, E // n_group)  # (N, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        kept = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices  # (N, g)
        in_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        # 2) the experts of the other groups cannot be chosen
        biased = biased.masked_fill(~in_kept.repeat_interleave(E // n_group, dim=1), -math.inf)
    # 3) the top_k by biased score; their weights from the unbiased scores
    experts = torch.topk(biased, top_k, dim=-1, sorted=False).indices  # (N, k)
    weights = scores.gather(1, experts)  # (N, k)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, experts


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
        self._check(x, experts, weights)
        k = experts.size(1)
        # 1) group: the (token, choice) pairs in order of expert id, then of token
        chosen = experts.flatten()  # (N·k,)
        order = chosen.argsort(stable=True)  # (N·k,)
        tokens = order // k  # the token of each sorted pair
        counts = torch.bincount(chosen, minlength=self.n_experts).tolist()  # one read back
        if len(counts) > self.n_experts:
            raise ValueError(f"experts must be expert ids 0 to {self.n_experts - 1}")
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

    def _check(self, x: Tensor, experts: Tensor, weights: Tensor) -> None:
        """Types and shapes only: nothing read back from the device."""
        D = self.down_proj.size(1)
        check_tensor("x", x, kind="float", dims=2, shape="(N, D)")
        check_tensor("experts", experts, kind="int", dims=2, shape="(N, k)")
        check_tensor("weights", weights, kind="float", dims=2, shape="(N, k)")
        if x.size(1) != D or experts.size(0) != x.size(0) or weights.shape != experts.shape:
            raise ValueError(
                f"x {tuple(x.shape)}, experts {tuple(experts.shape)} and weights "
                f"{tuple(weights.shape)} must agree: (N, D={D}), (N, k), (N, k)"
            )

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
        check_int("d_model", d_model, at_least=1)
        check_bool("norm_topk_prob", norm_topk_prob)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, d_ff, dropout=dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_with_router_logits(x)[0]

    def route(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`route` with this layer's settings: weights ``(N, k)`` and expert ids
        ``(N, k)``."""
        return route(router_logits, self.top_k, norm_topk_prob=self.norm_topk_prob)

    def _flat(self, x: Tensor) -> Tensor:
        """``x`` ``(..., D)`` checked and flattened to ``(N, D)``."""
        D = self.router.in_features
        check_tensor("x", x, kind="float", shape="(..., D)")
        if x.dim() == 0 or x.size(-1) != D:
            raise ValueError(f"x must be (..., D) with D = {D}, got shape {tuple(x.shape)}")
        return x.reshape(-1, D)

    def forward_with_router_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``(..., D)`` → the output ``(..., D)`` and the router's logits ``(N, E)``."""
        flat = self._flat(x)  # (N, D)
        logits = self.router(flat)  # (N, E)
        weights, experts = route(logits, self.top_k, norm_topk_prob=self.norm_topk_prob)
        return self.experts(flat, experts, weights).view(x.shape), logits


class DeepSeekMoE(MixtureOfExperts):
    """DeepSeek-V3's sparse feed-forward layer (``transformers``' ``DeepseekV3MoE``): the
    routed experts of :class:`MixtureOfExperts`, chosen by :func:`group_limited_route`, plus
    ``n_shared_experts`` shared experts that every token runs, one SwiGLU of width
    ``n_shared_experts · d_ff`` added to the routed output.

    The router's logits are computed in float32 whatever the weights' dtype (DeepSeek's
    checkpoints keep the router in float32). ``correction_bias`` ``(E,)``, a buffer saved with
    the weights (``e_score_correction_bias``), only steers which experts are chosen; no gradient
    reaches it: :func:`update_correction_bias` moves it between training steps.

    Args:
        d_model, d_ff, n_experts, top_k, dropout: as :class:`MixtureOfExperts`.
        n_shared_experts: shared experts (0: none).
        n_group: groups of experts (``n_group``); 1: no grouping.
        topk_group: groups a token may choose from (``topk_group``).
        norm_topk_prob: divide the ``top_k`` weights by their sum (DeepSeek-V3: True).
        routed_scaling_factor: multiplies the routed weights (DeepSeek-V3: 2.5).

    Shapes:
        x ``(..., D)`` → ``(..., D)``; router logits ``(N, E)`` in float32.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int,
        *,
        n_shared_experts: int = 1,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        dropout: float = 0.0,
    ):
        check_groups(n_experts, top_k, n_group, topk_group)
        check_int("n_shared_experts", n_shared_experts, at_least=0)
        check_number("routed_scaling_factor", routed_scaling_factor, low=0.0, low_open=True)
        super().__init__(
            d_model, d_ff, n_experts, top_k, norm_topk_prob=norm_topk_prob, dropout=dropout
        )
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.register_buffer("correction_bias", torch.zeros(n_experts))
        self.shared_experts = (
            SwiGLU(d_model, d_ff * n_shared_experts, dropout=dropout) if n_shared_experts else None
        )

    def reset_buffers(self) -> None:
        """The correction bias back to zeros, as built (no expert favoured yet)."""
        with torch.no_grad():
            self.correction_bias.zero_()

    def route(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`group_limited_route` with this layer's settings and bias: weights ``(N, k)``
        and expert ids ``(N, k)``."""
        return group_limited_route(
            router_logits,
            self.correction_bias,
            self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def forward_with_router_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``(..., D)`` → the output ``(..., D)`` and the router's logits ``(N, E)``."""
        flat = self._flat(x)  # (N, D)
        logits = F.linear(flat.float(), self.router.weight.float())  # (N, E), float32
        weights, experts = self.route(logits)  # (N, k) each
        out = self.experts(flat, experts, weights).view(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, logits


def update_correction_bias(correction_bias: Tensor, counts: Tensor, step_size: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, one update (§2.1.2 of the report): each
    expert's bias moves by ``step_size`` (γ) toward the mean load, up for an expert that
    received fewer tokens than the mean, down for one that received more (an expert exactly at
    the mean keeps its bias). In place, outside autograd; call it after each training step with
    the counts of that step's batch. Keep the bias in float32, as DeepSeek's checkpoints do: in
    bf16 a step of 0.001 is rounded to 0.002 on a bias near 0.3 and to 0 on one near 0.7.

    Shapes:
        correction_bias ``(E,)``; counts ``(E,)``, the tokens each expert received.
    """
    check_tensor("correction_bias", correction_bias, kind="float", dims=1, shape="(E,)")
    check_tensor("counts", counts, shape="(E,)")
    check_number("step_size", step_size, low=0.0)
    if counts.shape != correction_bias.shape or counts.dim() != 1:
        raise ValueError(
            f"counts must have correction_bias's shape {tuple(correction_bias.shape)}, one per "
            f"expert, got {tuple(counts.shape)}"
        )
    load = counts.to(correction_bias.dtype)
    with torch.no_grad():
        correction_bias.add_(torch.sign(load.mean() - load), alpha=step_size)


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
    _check_router_logits(router_logits, padding_mask)
    logits = torch.cat(list(router_logits))  # (L·N, E)
    n_layers, (rows, n_experts) = len(router_logits), router_logits[0].shape
    check_experts(n_experts, top_k)
    probs = F.softmax(logits.float(), dim=-1)  # (L·N, E)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # (L·N, k)
    if padding_mask is None:
        real = probs.new_ones(n_layers * rows)
    else:
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
    _check_router_logits(router_logits, padding_mask)
    return torch.stack(
        [
            load_balancing_loss((logits,), top_k, padding_mask=padding_mask)
            for logits in router_logits
        ]
    )


def tokens_per_expert(
    router_logits: Sequence[Tensor],
    top_k: int,
    *,
    padding_mask: Tensor | None = None,
    layers: Sequence[MixtureOfExperts] | None = None,
) -> Tensor:
    """How many tokens each layer sends to each expert (padding not counted).

    The experts are chosen as :func:`route` chooses them, Qwen3-MoE's softmax top-k, unless
    ``layers`` gives the mixtures that produced the logits, in order: then each chooses as it
    routes. A ``router="sigmoid"`` model's (:class:`DeepSeekMoE`) choice reads its correction
    bias and groups, which its logits alone do not hold: pass its layers, or the counts are
    another router's.

    Shapes:
        router_logits: one ``(N, E)`` per sparse layer; padding_mask ``(B, T)``, ``B·T = N``
        → counts ``(L, E)``, each row summing to ``k`` × the real tokens.
    """
    _check_router_logits(router_logits, padding_mask)
    check_experts(router_logits[0].size(-1), top_k)
    if layers is None:
        layers = [None] * len(router_logits)
    elif not isinstance(layers, (list, tuple)) or len(layers) != len(router_logits):
        raise ValueError(
            f"layers must be a list of the {len(router_logits)} mixtures that produced "
            f"router_logits, got {layers!r}"
        )
    counts = []
    for i, (logits, layer) in enumerate(zip(router_logits, layers, strict=True)):
        if layer is None:
            _, chosen = route(logits, top_k, norm_topk_prob=False)  # (N, k)
        else:
            check_type(f"layers[{i}]", layer, MixtureOfExperts, "a MixtureOfExperts")
            if (layer.top_k, layer.router.out_features) != (top_k, logits.size(-1)):
                raise ValueError(
                    f"layers[{i}] routes each token to {layer.top_k} of "
                    f"{layer.router.out_features} experts; its logits have {logits.size(-1)} "
                    f"and top_k is {top_k}"
                )
            _, chosen = layer.route(logits)  # (N, k)
        if padding_mask is not None:
            chosen = chosen[~padding_mask.flatten()]
        counts.append(torch.bincount(chosen.flatten(), minlength=logits.size(-1)))
    return torch.stack(counts)


def _check_router_logits(router_logits: object, padding_mask: object) -> None:
    """One float ``(N, E)`` per sparse layer, all of one shape; ``padding_mask`` None or a bool
    ``(B, T)`` with ``B·T = N``."""
    if isinstance(router_logits, Tensor) or not isinstance(router_logits, (list, tuple)):
        raise TypeError(
            "router_logits must be a list or tuple of (N, E) tensors, one per sparse layer, "
            f"got {type(router_logits).__name__}"
        )
    if not router_logits:
        raise ValueError("router_logits is empty: the model has no mixture-of-experts layer")
    for i, logits in enumerate(router_logits):
        check_tensor(f"router_logits[{i}]", logits, kind="float", dims=2, shape="(N, E)")
        if logits.shape != router_logits[0].shape:
            raise ValueError(
                f"router_logits[{i}] has shape {tuple(logits.shape)}, router_logits[0] "
                f"{tuple(router_logits[0].shape)}: every layer routes the same N tokens among "
                "the same E experts"
            )
    rows = router_logits[0].size(0)
    if padding_mask is not None:
        check_tensor("padding_mask", padding_mask, kind="bool", dims=2, shape="(B, T)")
        if padding_mask.numel() != rows:
            raise ValueError(
                f"padding_mask must be (B, T) with B·T = {rows}, the router logits' rows (True "
                f"at padding), got {tuple(padding_mask.shape)}"
            )


# The fields only chapter 20's mixture of experts reads (n_experts=0: every layer dense).
MOE_FIELDS = MappingProxyType(
    {
        "n_experts_per_token": 1,
        "moe_d_ff": None,
        "norm_topk_prob": False,
        "sparse_step": 1,
        "dense_layers": (),
        "router_aux_loss_coef": 0.001,
        "router": "softmax",
    }
)


class MixturePiece(Piece):
    """A ``router`` choice: the mixture of experts of the layers ``config.is_sparse`` names,
    and whether a load-balancing loss balances it in training (``balanced_by_loss``)."""

    balanced_by_loss = True

    def check(self, config: Any) -> None:
        check_int("n_experts", config.n_experts, at_least=0)
        if config.n_experts == 0:
            fields = {**MOE_FIELDS, **self.owns}
            chosen = [
                f"{k}={getattr(config, k)!r}" for k, v in fields.items() if getattr(config, k) != v
            ]
            if chosen:
                raise ValueError(f"{', '.join(chosen)}: mixture of experts only; set n_experts")
            return
        check_experts(
            config.n_experts, config.n_experts_per_token, top_k_name="n_experts_per_token"
        )
        check_optional_int("moe_d_ff", config.moe_d_ff, at_least=1)
        check_int("sparse_step", config.sparse_step, at_least=1)
        check_number("router_aux_loss_coef", config.router_aux_loss_coef, low=0.0)
        if not isinstance(config.dense_layers, tuple) or not all(
            type(i) is int and 0 <= i < config.n_layers for i in config.dense_layers
        ):
            raise ValueError(
                f"dense_layers must be a tuple of layer indices 0 to {config.n_layers - 1}, "
                f"got {config.dense_layers!r}"
            )
        if config.activation != "swiglu" or config.bias:
            raise ValueError(
                "the experts are SwiGLU layers without biases: set activation='swiglu' and "
                f"bias=False with n_experts (got {config.activation!r}, bias={config.bias})"
            )

    def build(self, config: Any) -> MixtureOfExperts:
        return MixtureOfExperts(
            config.d_model,
            config.moe_d_ff or config.d_ff,
            config.n_experts,
            config.n_experts_per_token,
            norm_topk_prob=config.norm_topk_prob,
            dropout=config.dropout,
        )


class DeepSeekPiece(MixturePiece):
    """``router="sigmoid"``: DeepSeek-V3's mixture (:class:`DeepSeekMoE`), balanced by its
    correction bias rather than a loss."""

    owns = MappingProxyType(
        {"n_shared_experts": 0, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}
    )
    balanced_by_loss = False

    def check(self, config: Any) -> None:
        super().check(config)
        if config.n_experts == 0:
            return
        check_groups(
            config.n_experts,
            config.n_experts_per_token,
            config.n_group,
            config.topk_group,
            top_k_name="n_experts_per_token",
        )
        check_int("n_shared_experts", config.n_shared_experts, at_least=0)
        check_number("routed_scaling_factor", config.routed_scaling_factor, low=0.0, low_open=True)

    def build(self, config: Any) -> DeepSeekMoE:
        return DeepSeekMoE(
            config.d_model,
            config.moe_d_ff or config.d_ff,
            config.n_experts,
            config.n_experts_per_token,
            n_shared_experts=config.n_shared_experts,
            n_group=config.n_group,
            topk_group=config.topk_group,
            norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
            dropout=config.dropout,
        )


ROUTERS.register("softmax", MixturePiece())
ROUTERS.register("sigmoid", DeepSeekPiece())
