"""moe: the router, the experts and the block equal transformers' Qwen3MoeSparseMoeBlock
(outputs and router logits, float32, 1e-5) for expert counts and top-k from 1 to E,
norm_topk_prob both ways, ties included; the grouped experts equal a loop over tokens (float64);
the load-balancing loss equals load_balancing_loss_func with and without padding, is k whenever the
counts are even, falls below k with idle experts, and in bf16 stays nearer float64 than theirs;
the per-layer loss equals a hand computation, layer by layer; the model's router logits reach the
caller and the loss trains the router; bad input is refused by name.
DeepSeek-V3's block equals DeepseekV3MoE (outputs, router logits, chosen experts and weights) for
one group and several, fewer groups kept than there are, norm_topk_prob both ways, scaling
factors other than 1, a correction bias that changes the choice, ties, and bf16; the groups
ranked by their two best scores by hand; the bias update by hand.
(Whole models against Qwen3MoeForCausalLM: test_lm_moe_weights.py; against
DeepseekV3ForCausalLM: test_lm_deepseek_weights.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeSparseMoeBlock,
    load_balancing_loss_func,
)

from helpers import lm_config, raises, randomized, to_device
from transformer_tutorial.lm.config import QWEN3, LMConfig
from transformer_tutorial.lm.deepseek_weights import copy_block_to_deepseek_v3
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.moe import (
    DeepSeekMoE,
    Experts,
    MixtureOfExperts,
    group_limited_route,
    load_balancing_loss,
    load_balancing_loss_per_layer,
    route,
    tokens_per_expert,
    update_correction_bias,
)

D, F_, B, T = 16, 12, 3, 7
ATOL = RTOL = 1e-5  # float32
SHAPES = [(4, 2, True), (4, 2, False), (8, 1, False), (3, 3, True), (6, 4, False), (1, 1, True)]


def pair(n_experts: int, top_k: int, norm: bool, seed: int = 0):
    """Their sparse block with random weights, and ours with the same weights."""
    config = Qwen3MoeConfig(
        hidden_size=D,
        moe_intermediate_size=F_,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
    )
    theirs = randomized(Qwen3MoeSparseMoeBlock(config), seed)
    ours = MixtureOfExperts(D, F_, n_experts, top_k, norm_topk_prob=norm).eval()
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        gate, up = theirs.experts.gate_up_proj.chunk(2, dim=1)
        ours.experts.gate_proj.copy_(gate)
        ours.experts.up_proj.copy_(up)
        ours.experts.down_proj.copy_(theirs.experts.down_proj)
    return ours, theirs


def x(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def router_logits_of(block: Qwen3MoeSparseMoeBlock, hidden: torch.Tensor) -> torch.Tensor:
    return block.gate(hidden.reshape(-1, D))[0]


@pytest.mark.parametrize(("n_experts", "top_k", "norm"), SHAPES)
def test_block_equals_qwen3_moe_sparse_block(n_experts, top_k, norm, device):
    ours, theirs = to_device(pair(n_experts, top_k, norm), device)
    hidden = x().to(device)
    with torch.no_grad():
        got, logits = ours.forward_with_router_logits(hidden)
        expected = theirs(hidden)
        torch.testing.assert_close(logits, router_logits_of(theirs, hidden), atol=ATOL, rtol=RTOL)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours(hidden), got)


def test_ties_go_where_torch_topk_puts_them():
    """Experts 1 and 2 (and 0 and 3) share a router row, so their scores tie for every token:
    top-2 of 5 must split such pairs as torch.topk does, and as transformers does."""
    ours, theirs = pair(5, 2, False, seed=3)
    with torch.no_grad():
        for block in (ours.router.weight, theirs.gate.weight):
            block[2] = block[1]
            block[3] = block[0]
        hidden = x(3)
        logits = ours.router(hidden.reshape(-1, D))
        probs = F.softmax(logits, dim=-1)
        _, experts = route(logits, 2, norm_topk_prob=False)
        assert torch.equal(experts, torch.topk(probs, 2, dim=-1).indices)
        first, second = probs.gather(1, experts).unbind(1)
        assert (first == second).any()  # some tokens' top-2 is a tied pair
        torch.testing.assert_close(ours(hidden), theirs(hidden), atol=ATOL, rtol=RTOL)


def test_route_renormalises_only_with_norm_topk_prob():
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    probs = logits.softmax(-1)
    kept, experts = route(logits, 3, norm_topk_prob=False)
    normed, same = route(logits, 3, norm_topk_prob=True)
    assert torch.equal(experts, same)
    torch.testing.assert_close(kept, probs.gather(1, experts))
    torch.testing.assert_close(normed, kept / kept.sum(-1, keepdim=True))
    assert (kept.sum(-1) < 0.99).all()
    torch.testing.assert_close(normed.sum(-1), torch.ones(10))
    assert (kept[:, :-1] >= kept[:, 1:]).all()  # each row in decreasing weight


@pytest.mark.parametrize(("n_experts", "top_k"), [(4, 2), (5, 1), (3, 3)])
def test_grouped_experts_equal_a_loop_over_tokens(n_experts, top_k):
    """float64, against each token's chosen experts summed one by one; expert 0 is never chosen
    (an empty group)."""
    g = torch.Generator().manual_seed(1)
    experts_module = Experts(n_experts, D, F_).double()
    tokens = torch.randn(9, D, generator=g, dtype=torch.float64)
    scores = torch.rand(9, n_experts, generator=g, dtype=torch.float64)
    if top_k < n_experts:
        scores[:, 0] = -1.0
    weights, experts = scores.topk(top_k, dim=-1)
    e = experts_module
    expected = torch.zeros_like(tokens)
    for n in range(9):
        for j in range(top_k):
            i, t = experts[n, j], tokens[n]
            hidden = F.silu(e.gate_proj[i] @ t) * (e.up_proj[i] @ t)
            expected[n] += weights[n, j] * (e.down_proj[i] @ hidden)
    torch.testing.assert_close(e(tokens, experts, weights), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_load_balancing_loss_equals_transformers(top_k, padded):
    """Three sparse layers pooled, as transformers pools them; padding excluded with a mask."""
    g = torch.Generator().manual_seed(top_k)
    layers = tuple(torch.randn(B * T, 4, generator=g) * 2 for _ in range(3))
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[0, 4:], padding[2, 1:] = True, True
    mask = (~padding).long() if padded else None
    expected = load_balancing_loss_func(layers, 4, top_k, mask)
    got = load_balancing_loss(layers, top_k, padding_mask=padding if padded else None)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_load_balancing_loss_is_k_when_uniform_and_ignores_padding():
    uniform = (torch.zeros(6, 4),)
    torch.testing.assert_close(load_balancing_loss(uniform, 2), torch.tensor(2.0))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B * T, 4, generator=g)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, 3:] = True
    changed = logits.clone()
    changed[padding.flatten()] = 10 * torch.randn(int(padding.sum()), 4, generator=g)
    same = load_balancing_loss((changed,), 2, padding_mask=padding)
    torch.testing.assert_close(load_balancing_loss((logits,), 2, padding_mask=padding), same)
    assert load_balancing_loss((changed,), 2) != same  # without the mask padding counts
    collapsed = torch.zeros(6, 4)
    collapsed[:, 0] = 20.0  # every token to expert 0 (and, second, to expert 1)
    assert load_balancing_loss((collapsed,), 1) > 3.9  # E · 1 · 1 = 4 at the limit


def test_load_balancing_loss_is_k_whenever_the_counts_are_even():
    """Token n's largest logit is expert n mod E (top-1) or experts n, n + 1 mod E (top-2),
    every other logit random: the counts are even, the probabilities not."""
    g = torch.Generator().manual_seed(1)
    for top_k in (1, 2):
        logits = torch.randn(24, 4, generator=g)
        for j in range(top_k):
            logits[torch.arange(24), (torch.arange(24) + j) % 4] += 10.0
        assert (tokens_per_expert((logits,), top_k) == 24 * top_k // 4).all()
        torch.testing.assert_close(
            load_balancing_loss((logits,), top_k), torch.tensor(top_k * 1.0)
        )


def test_load_balancing_loss_falls_below_k_with_idle_experts():
    """Half the tokens to expert 0, half to expert 1, each with its probability barely above
    what it parks on the idle experts 2 and 3: 2/3 < k = 1, ours == transformers'."""
    eps = 1e-6
    rows = torch.tensor(
        [[1 / 3 + eps, 0.0, 1 / 3, 1 / 3 - eps], [0.0, 1 / 3 + eps, 1 / 3, 1 / 3 - eps]]
    )
    logits = rows.log().repeat_interleave(8, dim=0)  # (16, 4)
    assert tokens_per_expert((logits,), 1).tolist() == [[8, 8, 0, 0]]
    loss = load_balancing_loss((logits,), 1)
    torch.testing.assert_close(loss, load_balancing_loss_func((logits,), 4, 1))
    torch.testing.assert_close(loss, torch.tensor(2 / 3), atol=1e-5, rtol=0)


def test_load_balancing_loss_in_bf16_is_nearer_float64_than_transformers():
    """bf16 logits: ours softmaxes in float32 (as the router does), theirs in bf16; against the
    loss computed by hand in float64, ours is within 1e-5, theirs farther."""
    g = torch.Generator().manual_seed(2)
    layers = tuple((torch.randn(256, 16, generator=g) * 2).bfloat16() for _ in range(3))
    probs = torch.cat(layers).double().softmax(-1)
    chosen = probs.topk(4, dim=-1).indices
    f = torch.zeros(16, dtype=torch.float64).index_add_(
        0, chosen.flatten(), torch.ones(chosen.numel(), dtype=torch.float64)
    )
    exact = 16 * (f / len(probs) * probs.mean(0)).sum()
    ours = (load_balancing_loss(layers, 4).double() - exact).abs()
    theirs = (load_balancing_loss_func(layers, 16, 4).double() - exact).abs()
    assert ours < 1e-5 and ours < theirs


@pytest.mark.parametrize("padded", [False, True])
def test_load_balancing_loss_per_layer_equals_a_hand_computation(padded):
    """One loss per sparse layer, E · Σ_e f_e · P_e over that layer's real tokens, computed
    here with loops: three random layers and one collapsed onto expert 2."""
    g = torch.Generator().manual_seed(5)
    layers = [torch.randn(B * T, 4, generator=g) * 2 for _ in range(3)]
    layers.append(torch.zeros(B * T, 4).index_fill_(1, torch.tensor([2]), 20.0))
    padding = torch.zeros(B, T, dtype=torch.bool)
    if padded:
        padding[0, 4:], padding[2, 1:] = True, True
    real = [n for n in range(B * T) if not padding.flatten()[n]]
    top_k = 2
    expected = []
    for logits in layers:
        f, p = [0.0] * 4, [0.0] * 4
        for n in real:
            probs = logits[n].double().softmax(-1)
            for e in probs.topk(top_k).indices.tolist():
                f[e] += 1 / len(real)
            for e in range(4):
                p[e] += probs[e].item() / len(real)
        expected.append(4 * sum(fe * pe for fe, pe in zip(f, p, strict=True)))
    got = load_balancing_loss_per_layer(layers, top_k, padding_mask=padding if padded else None)
    assert got.shape == (4,)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32))
    assert got[3] > 3.9  # the collapsed layer: near E · 1 · 1 (its second choice gets P ≈ 0)


def test_pooling_lets_collapsed_layers_cancel_and_the_per_layer_loss_does_not():
    """Four layers, each sending every token to a different expert (k = 1): pooled, the
    counts and probabilities look even (1 = k, as transformers computes it); per layer, each
    scores the most it can, E = 4."""
    layers = [torch.zeros(10, 4).index_fill_(1, torch.tensor([i]), 20.0) for i in range(4)]
    pooled = load_balancing_loss(layers, 1)
    torch.testing.assert_close(pooled, load_balancing_loss_func(tuple(layers), 4, 1))
    torch.testing.assert_close(pooled, torch.tensor(1.0))
    torch.testing.assert_close(load_balancing_loss_per_layer(layers, 1), torch.full((4,), 4.0))


def moe_config(**changes) -> LMConfig:
    moe = dict(n_experts=4, n_experts_per_token=2, moe_d_ff=24, sparse_step=1)
    return lm_config(**(dict(QWEN3) | dict(n_kv_heads=2, dropout=0.0) | moe | changes))


def test_the_model_returns_each_sparse_layers_router_logits_and_steps_alike():
    """Layers 0 and 2 sparse (step 1, layer 1 dense): two router logits (B·T, E); logits
    equal to the forward pass's; tokens per expert count k per real token."""
    model = randomized(LanguageModel(moe_config(dense_layers=(1,))), 0)
    ids = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, routers = model.forward_with_router_logits(ids)
    assert torch.equal(logits, model(ids))
    assert [tuple(r.shape) for r in routers] == [(B * T, 4)] * 2
    assert type(model.layers[1].ff).__name__ == "SwiGLU"
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[0, 5:] = True
    counts = tokens_per_expert(routers, 2, padding_mask=padding)
    assert counts.shape == (2, 4) and (counts.sum(1) == 2 * (B * T - 2)).all()


def test_the_load_balancing_loss_reaches_the_router_only():
    """Its gradient flows through the router's probabilities (the counts f have none): a small
    step against it lowers the loss without changing the routing; the experts get none."""
    block = randomized(MixtureOfExperts(D, F_, 4, 2), 6)
    hidden = x(6)
    logits = block.forward_with_router_logits(hidden)[1]
    before = load_balancing_loss((logits,), 2)
    before.backward()
    assert block.experts.gate_proj.grad is None
    with torch.no_grad():
        block.router.weight -= 1e-2 * block.router.weight.grad
        after = block.forward_with_router_logits(hidden)[1]
    assert torch.equal(
        route(after, 2, norm_topk_prob=False)[1], route(logits, 2, norm_topk_prob=False)[1]
    )
    assert load_balancing_loss((after,), 2) < before - 1e-4


BAD_BLOCKS = [
    (dict(n_experts=0, top_k=1), ValueError, "n_experts"),
    (dict(n_experts=4, top_k=5), ValueError, "top_k=5 exceeds n_experts=4"),
    (dict(n_experts=4, top_k=0), ValueError, "top_k"),
    (dict(n_experts=4, top_k=2, norm_topk_prob=1), TypeError, "norm_topk_prob"),
]


@pytest.mark.parametrize(("kwargs", "error", "phrase"), BAD_BLOCKS)
def test_bad_blocks_are_refused_by_name(kwargs, error, phrase):
    raises(lambda: MixtureOfExperts(D, F_, **kwargs), error, phrase)


BAD_CONFIGS = [
    (dict(n_experts=-1), "n_experts"),
    (dict(n_experts=4, n_experts_per_token=5), "n_experts_per_token=5 exceeds n_experts=4"),
    (dict(n_experts=0, n_experts_per_token=2), "set n_experts"),
    (dict(n_experts=0, norm_topk_prob=True), "norm_topk_prob=True"),
    (dict(n_experts=4, dense_layers=(3,)), "dense_layers must be a tuple of layer indices 0 to 2"),
    (dict(n_experts=4, dense_layers=[0]), "dense_layers"),
    (dict(n_experts=4, sparse_step=0), "sparse_step"),
    (dict(n_experts=4, moe_d_ff=0), "moe_d_ff"),
    (dict(n_experts=4, activation="gelu", bias=False), "activation='swiglu'"),
    (dict(n_experts=4, activation="swiglu", bias=True), "bias=False"),
]


@pytest.mark.parametrize(("changes", "phrase"), BAD_CONFIGS)
def test_bad_moe_configs_are_refused_by_name(changes, phrase):
    base = dict(activation="swiglu", bias=False)
    raises(lambda: lm_config(**(base | changes)), ValueError, phrase)


def test_bad_load_balancing_inputs_are_refused_by_name():
    logits = (torch.zeros(6, 4),)
    raises(lambda: load_balancing_loss((), 1), ValueError, "router_logits is empty")
    raises(lambda: load_balancing_loss(logits, 5), ValueError, "top_k=5 exceeds n_experts=4")
    wrong = torch.zeros(2, 4, dtype=torch.bool)
    raises(lambda: load_balancing_loss(logits, 1, padding_mask=wrong), ValueError, "B·T = 6")
    raises(lambda: load_balancing_loss_per_layer((), 1), ValueError, "router_logits is empty")
    raises(lambda: load_balancing_loss_per_layer(logits, 5), ValueError, "top_k=5 exceeds")


def test_the_stacked_expert_weights_are_split_once_not_indexed_per_expert():
    """Indexing ``gate_proj[e]`` per expert gives each expert a gradient of the full stacked
    size (128 experts: 128 full-size gradients summed, 3.8 s a backward pass at the bench's
    CPU size instead of 0.24 s); ``unbind`` splits each stacked tensor once."""
    block = MixtureOfExperts(D, F_, 6, 2)
    seen, stack = set(), [block(x()).sum().grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    names = {type(node).__name__ for node in seen}
    assert "UnbindBackward0" in names and "SelectBackward0" not in names


# DeepSeek-V3's mixture (n_experts, top_k, n_group, topk_group, norm_topk_prob, routed scaling,
# shared experts): one group; groups all kept; fewer groups kept than there are (2 of 4, 1 of 3);
# top_k = E; no renormalisation; scaling factors 1, 1.5, 2.5 (DeepSeek-V3's).
DEEPSEEK_SHAPES = {
    "one-group": (8, 2, 1, 1, True, 1.0, 1),
    "2-of-4-groups": (8, 3, 4, 2, True, 2.5, 2),
    "1-of-3-groups-unnormed": (12, 4, 3, 1, False, 1.5, 1),
    "all-4-groups-unnormed": (16, 4, 4, 4, False, 2.5, 1),
    "k-is-E": (6, 6, 1, 1, True, 2.5, 1),
}


def deepseek_pair(name: str, seed: int = 0, *, bias_scale: float = 0.3):
    """Their DeepseekV3MoE with random weights and a random correction bias (``bias_scale``),
    and ours with the same weights, copied by ``copy_block_to_deepseek_v3``."""
    n_experts, top_k, n_group, topk_group, norm, scale, shared = DEEPSEEK_SHAPES[name]
    config = DeepseekV3Config(
        hidden_size=D,
        moe_intermediate_size=F_,
        n_routed_experts=n_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
        n_shared_experts=shared,
    )
    theirs = randomized(DeepseekV3MoE(config), seed)
    ours = DeepSeekMoE(
        D,
        F_,
        n_experts,
        top_k,
        n_shared_experts=shared,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    ).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        ours.correction_bias.copy_(bias_scale * torch.randn(n_experts, generator=g))
        for p in ours.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    copy_block_to_deepseek_v3(ours, theirs)
    return ours, theirs


@pytest.mark.parametrize("name", DEEPSEEK_SHAPES)
def test_deepseek_block_equals_deepseek_v3_moe(name, device):
    """Outputs, router logits and the chosen experts and weights, float32, 1e-5."""
    ours, theirs = to_device(deepseek_pair(name), device)
    hidden = x().to(device)
    with torch.no_grad():
        got, logits = ours.forward_with_router_logits(hidden)
        their_logits, their_weights, their_experts = theirs.gate(hidden)
        expected = theirs(hidden)
        weights, experts = ours.route(logits)
    torch.testing.assert_close(logits, their_logits, atol=ATOL, rtol=RTOL)
    assert torch.equal(experts, their_experts)
    torch.testing.assert_close(weights, their_weights, atol=ATOL, rtol=RTOL)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours(hidden), got)


def test_the_correction_bias_changes_the_choice_but_not_the_weights():
    """With the bias, other experts are chosen for some tokens (and theirs agree); the weights
    are the chosen experts' unbiased sigmoid scores, normalised, times the scaling factor."""
    ours, theirs = deepseek_pair("2-of-4-groups", 1, bias_scale=1.0)
    hidden = x(1)
    with torch.no_grad():
        logits = ours.forward_with_router_logits(hidden)[1]
        weights, experts = ours.route(logits)
        unbiased = group_limited_route(
            logits,
            torch.zeros(8),
            3,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )[1]
        torch.testing.assert_close(ours(hidden), theirs(hidden), atol=ATOL, rtol=RTOL)
    assert not torch.equal(experts.sort(-1).values, unbiased.sort(-1).values)
    chosen = logits.sigmoid().gather(1, experts)
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_groups_are_ranked_by_their_two_best_scores():
    """Expert 0 has the best score, but group 1 (experts 2, 3) has the best two: with one group
    kept, expert 0 cannot be chosen; with both, it is. Hand-computed, then as theirs."""
    logits = torch.logit(torch.tensor([[0.9, 0.1, 0.8, 0.7]]))
    bias = torch.zeros(4)
    settings = dict(norm_topk_prob=False, routed_scaling_factor=1.0)
    weights, experts = group_limited_route(logits, bias, 1, n_group=2, topk_group=1, **settings)
    assert experts.tolist() == [[2]]
    torch.testing.assert_close(weights, torch.tensor([[0.8]]))
    both = group_limited_route(logits, bias, 1, n_group=2, topk_group=2, **settings)
    assert both[1].tolist() == [[0]]
    # the bias ranks the groups too: +0.5 on expert 1 makes group 0's best two 0.9 + 0.6
    bias[1] = 0.5
    weights, experts = group_limited_route(logits, bias, 2, n_group=2, topk_group=1, **settings)
    assert sorted(experts[0].tolist()) == [0, 1]
    torch.testing.assert_close(weights.sort(-1).values, torch.tensor([[0.1, 0.9]]))


def test_deepseek_ties_go_where_torch_topk_puts_them():
    """Zero router weights and bias: every score is 0.5, every group ties, every expert ties;
    and a router whose rows repeat: the same experts as theirs either way."""
    ours, theirs = deepseek_pair("2-of-4-groups", 2, bias_scale=0.0)
    hidden = x(2)
    rows = torch.randn(2, D, generator=torch.Generator().manual_seed(2)).repeat(4, 1)  # (8, D)
    for fill in ("zeros", "repeated rows"):
        with torch.no_grad():
            for w in (ours.router.weight, theirs.gate.weight):
                if fill == "zeros":
                    w.zero_()
                else:
                    w.copy_(rows)
            _, their_weights, their_experts = theirs.gate(hidden)
            weights, experts = ours.route(ours.forward_with_router_logits(hidden)[1])
            assert torch.equal(experts, their_experts)
            torch.testing.assert_close(weights, their_weights)
            torch.testing.assert_close(ours(hidden), theirs(hidden), atol=ATOL, rtol=RTOL)


def test_deepseek_block_in_bf16_routes_as_theirs_in_float32():
    """Both in bf16: the router runs in float32 on both sides, so the same experts are chosen;
    the outputs differ by bf16 rounding, each within 2 % of the float32 output's scale."""
    ours, theirs = deepseek_pair("2-of-4-groups", 3)
    hidden = x(3)
    with torch.no_grad():
        reference = theirs(hidden)
        ours, theirs, low = ours.bfloat16(), theirs.bfloat16(), hidden.bfloat16()
        got, logits = ours.forward_with_router_logits(low)
        assert logits.dtype == torch.float32 and got.dtype == torch.bfloat16
        assert torch.equal(ours.route(logits)[1], theirs.gate(low)[2])
        expected = theirs(low)
    scale = reference.abs().max()
    assert (got.float() - reference).abs().max() < 0.02 * scale
    assert (got.float() - expected.float()).abs().max() < 0.02 * scale


def test_update_correction_bias_moves_each_bias_toward_the_mean_load():
    """Counts 5, 1, 3, 3 (mean 3): the overloaded expert's bias falls by γ, the idle one's
    rises by γ, the two at the mean keep theirs; refused input leaves the bias as it was."""
    bias = torch.tensor([0.1, 0.0, -0.2, 0.0])
    update_correction_bias(bias, torch.tensor([5, 1, 3, 3]), 0.01)
    torch.testing.assert_close(bias, torch.tensor([0.09, 0.01, -0.2, 0.0]))
    before = bias.clone()
    raises(lambda: update_correction_bias(bias, torch.ones(3), 0.01), ValueError, "counts")
    raises(lambda: update_correction_bias(bias, torch.ones(4), -1.0), ValueError, "step_size")
    assert torch.equal(bias, before)


def test_the_bias_update_is_lost_in_bf16_where_the_docstring_says():
    """A step of 0.001: doubled on a bf16 bias near 0.3, lost near 0.7 (and upward at 0.5);
    exact in float32."""
    counts = torch.tensor([0, 2, 2, 0])  # mean 1: experts 0 and 3 up, 1 and 2 down
    for dtype, expected in (
        (torch.bfloat16, [0.3 + 2**-9, 0.5 - 2**-9, 0.7, 0.5]),
        (torch.float32, [0.301, 0.499, 0.699, 0.501]),
    ):
        bias = torch.tensor([0.3, 0.5, 0.7, 0.5], dtype=dtype)
        update_correction_bias(bias, counts, 0.001)
        torch.testing.assert_close(bias, torch.tensor(expected, dtype=dtype), rtol=0, atol=1e-7)


def test_the_correction_bias_gets_no_gradient_and_is_saved():
    ours = deepseek_pair("one-group")[0].train()
    ours(x()).sum().backward()
    assert not ours.correction_bias.requires_grad and ours.router.weight.grad is not None
    assert "correction_bias" in ours.state_dict()


def test_a_sigmoid_router_config_builds_deepseek_blocks_after_the_dense_layers():
    config = moe_config(router="sigmoid", n_group=2, topk_group=1, dense_layers=(0,))
    model = LanguageModel(config)
    assert type(model.layers[0].ff).__name__ == "SwiGLU"
    assert all(isinstance(layer.ff, DeepSeekMoE) for layer in model.layers[1:])
    routers = model.forward_with_router_logits(torch.zeros(1, 4, dtype=torch.long))[1]
    assert len(routers) == 2


BAD_DEEPSEEK = [
    (dict(n_experts=6, n_group=4), "n_group=4 must divide n_experts=6"),
    (dict(n_group=2, topk_group=3), "topk_group=3 exceeds n_group=2"),
    (dict(n_group=4, topk_group=1, top_k=3), "top_k=3 exceeds the 2 experts of topk_group=1"),
    (dict(n_group=8, topk_group=1, top_k=1), "n_group=8 leaves 1 expert per group"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=9), "top_k=9 exceeds n_experts=8"),
    (dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
]


@pytest.mark.parametrize(("changes", "phrase"), BAD_DEEPSEEK)
def test_bad_deepseek_blocks_are_refused_by_name(changes, phrase):
    kwargs = dict(n_experts=8, top_k=2) | changes
    raises(lambda: DeepSeekMoE(D, F_, **kwargs), ValueError, phrase)


BAD_DEEPSEEK_CONFIGS = [
    (dict(n_group=2), "n_group=2: router='sigmoid' only; set router='sigmoid'"),
    (dict(n_shared_experts=1), "set router='sigmoid'"),
    (dict(router="sigmoidal"), "router must be one of"),
    (dict(n_experts=0, n_experts_per_token=1, router="sigmoid"), "set n_experts"),
    (dict(router="sigmoid", n_group=3), "n_group=3 must divide n_experts=4"),
    (dict(router="sigmoid", n_group=2, topk_group=1, n_experts_per_token=3), "exceeds the 2"),
    (dict(router="sigmoid", routed_scaling_factor=float("inf")), "routed_scaling_factor"),
]


@pytest.mark.parametrize(("changes", "phrase"), BAD_DEEPSEEK_CONFIGS)
def test_bad_deepseek_configs_are_refused_by_name(changes, phrase):
    raises(lambda: moe_config(**changes), ValueError, phrase)


def test_route_refuses_top_k_zero_and_more_than_the_experts():
    """torch.topk gives 0 experts a token without complaint, and a deep RuntimeError for 5 of 4."""
    logits = torch.zeros(6, 4)
    raises(lambda: route(logits, 0, norm_topk_prob=False), ValueError, "top_k")
    raises(lambda: route(logits, 5, norm_topk_prob=False), ValueError, "top_k=5 exceeds")
    raises(lambda: tokens_per_expert((logits,), 0), ValueError, "top_k")


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

NAN = float("nan")
L6 = torch.randn(6, 4)
BIAS4 = torch.zeros(4)
DS_ROUTE = dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
MOE_PROBES = {
    "route: logits a list": (
        lambda: route([[1.0, 2.0]], 1, norm_topk_prob=False),
        TypeError,
        "router_logits must be a Tensor (N, E), got list",
    ),
    "route: integer logits": (
        lambda: route(torch.ones(3, 4, dtype=torch.long), 1, norm_topk_prob=False),
        TypeError,
        "router_logits must be a floating-point tensor, got torch.int64",
    ),
    "route: (B, T, E) logits": (
        lambda: route(torch.randn(2, 3, 4), 1, norm_topk_prob=False),
        ValueError,
        "router_logits must be (N, E), got shape (2, 3, 4)",
    ),
    "route: norm_topk_prob 1": (
        lambda: route(L6, 1, norm_topk_prob=1),
        TypeError,
        "norm_topk_prob must be True or False, got 1",
    ),
    "group_limited_route: (B, T, E) logits": (
        lambda: group_limited_route(torch.randn(2, 3, 4), BIAS4, 1, **DS_ROUTE),
        ValueError,
        "router_logits must be (N, E), got shape (2, 3, 4)",
    ),
    "group_limited_route: integer bias": (
        lambda: group_limited_route(L6, BIAS4.long(), 1, **DS_ROUTE),
        TypeError,
        "correction_bias must be a floating-point tensor, got torch.int64",
    ),
    "group_limited_route: NaN scaling": (
        lambda: group_limited_route(L6, BIAS4, 1, **(DS_ROUTE | {"routed_scaling_factor": NAN})),
        ValueError,
        "routed_scaling_factor must be greater than 0.0, got nan",
    ),
    "group_limited_route: norm_topk_prob 1": (
        lambda: group_limited_route(L6, BIAS4, 1, **(DS_ROUTE | {"norm_topk_prob": 1})),
        TypeError,
        "norm_topk_prob must be True or False, got 1",
    ),
    "update_correction_bias: counts a list": (
        lambda: update_correction_bias(torch.zeros(4), [1, 2, 3, 4], 0.001),
        TypeError,
        "counts must be a Tensor (E,), got list",
    ),
    "update_correction_bias: integer bias": (
        lambda: update_correction_bias(torch.zeros(4, dtype=torch.long), torch.ones(4), 0.001),
        TypeError,
        "correction_bias must be a floating-point tensor, got torch.int64",
    ),
    "load_balancing_loss: one tensor": (
        lambda: load_balancing_loss(L6, 1),
        TypeError,
        "router_logits must be a list or tuple of (N, E) tensors, one per sparse layer",
    ),
    "load_balancing_loss: widths differ": (
        lambda: load_balancing_loss((L6, torch.randn(6, 5)), 1),
        ValueError,
        "router_logits[1] has shape (6, 5), router_logits[0] (6, 4)",
    ),
    "load_balancing_loss: rows differ": (
        lambda: load_balancing_loss((L6, torch.randn(5, 4)), 1),
        ValueError,
        "router_logits[1] has shape (5, 4)",
    ),
    "load_balancing_loss: integer logits": (
        lambda: load_balancing_loss((torch.ones(6, 4, dtype=torch.long),), 1),
        TypeError,
        "router_logits[0] must be a floating-point tensor, got torch.int64",
    ),
    "load_balancing_loss: padding mask a list": (
        lambda: load_balancing_loss((L6,), 1, padding_mask=[[False] * 6]),
        TypeError,
        "padding_mask must be a Tensor (B, T), got list",
    ),
    "load_balancing_loss_per_layer: one tensor": (
        lambda: load_balancing_loss_per_layer(L6, 1),
        TypeError,
        "router_logits must be a list or tuple",
    ),
    "tokens_per_expert: empty": (
        lambda: tokens_per_expert((), 1),
        ValueError,
        "router_logits is empty",
    ),
    "tokens_per_expert: one tensor": (
        lambda: tokens_per_expert(L6, 1),
        TypeError,
        "router_logits must be a list or tuple",
    ),
    "tokens_per_expert: padding of 5 for 6 rows": (
        lambda: tokens_per_expert((L6,), 1, padding_mask=torch.zeros(1, 5, dtype=torch.bool)),
        ValueError,
        "padding_mask must be (B, T) with B·T = 6",
    ),
    "tokens_per_expert: float padding": (
        lambda: tokens_per_expert((L6,), 1, padding_mask=torch.zeros(1, 6)),
        TypeError,
        "padding_mask must be a bool tensor, got torch.float32",
    ),
    "tokens_per_expert: layers of another k": (
        lambda: tokens_per_expert((L6,), 1, layers=[MixtureOfExperts(D, F_, 4, 2)]),
        ValueError,
        "layers[0] routes each token to 2 of 4 experts; its logits have 4 and top_k is 1",
    ),
    "tokens_per_expert: layers not mixtures": (
        lambda: tokens_per_expert((L6,), 1, layers=[torch.nn.Linear(2, 2)]),
        TypeError,
        "layers[0] must be a MixtureOfExperts, got Linear",
    ),
    "Experts: expert id 7 of 4": (
        lambda: Experts(4, 8, 6)(torch.randn(3, 8), torch.full((3, 1), 7), torch.ones(3, 1)),
        ValueError,
        "experts must be expert ids 0 to 3",
    ),
    "Experts: float expert ids": (
        lambda: Experts(4, 8, 6)(torch.randn(3, 8), torch.zeros(3, 1), torch.ones(3, 1)),
        TypeError,
        "experts must be an integer tensor, got torch.float32",
    ),
    "Experts: weights of another k": (
        lambda: Experts(4, 8, 6)(
            torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 1)
        ),
        ValueError,
        "x (3, 8), experts (3, 2) and weights (3, 1) must agree: (N, D=8), (N, k), (N, k)",
    ),
    "MixtureOfExperts: d_model a float": (
        lambda: MixtureOfExperts(8.0, 6, 4, 2),
        TypeError,
        "d_model must be an int, got 8.0",
    ),
    "MixtureOfExperts: x of another width": (
        lambda: MixtureOfExperts(8, 6, 4, 2)(torch.randn(2, 3, 7)),
        ValueError,
        "x must be (..., D) with D = 8, got shape (2, 3, 7)",
    ),
    "MixtureOfExperts: integer x": (
        lambda: MixtureOfExperts(8, 6, 4, 2)(torch.ones(2, 8, dtype=torch.long)),
        TypeError,
        "x must be a floating-point tensor, got torch.int64",
    ),
    "DeepSeekMoE: x of another width": (
        lambda: DeepSeekMoE(8, 6, 4, 2)(torch.randn(2, 3, 7)),
        ValueError,
        "x must be (..., D) with D = 8, got shape (2, 3, 7)",
    ),
}


@pytest.mark.parametrize(("call", "error", "phrase"), MOE_PROBES.values(), ids=MOE_PROBES.keys())
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)


def test_a_refused_bias_update_leaves_the_bias_as_it_was():
    bias = torch.tensor([0.1, -0.2, 0.3, 0.0])
    raises(lambda: update_correction_bias(bias, torch.ones(5), 0.1), ValueError, "counts")
    assert torch.equal(bias, torch.tensor([0.1, -0.2, 0.3, 0.0]))


def test_tokens_per_expert_counts_a_sigmoid_router_as_it_routes_given_its_layers():
    """The softmax top-k of a DeepSeek layer's logits ignores its correction bias and groups:
    given its layers, tokens_per_expert counts the experts the layer really chose."""
    torch.manual_seed(0)
    layer = DeepSeekMoE(D, F_, 8, 2, n_group=4, topk_group=2).eval()
    with torch.no_grad():
        layer.correction_bias.copy_(torch.tensor([2.0, 2.0, 0, 0, 0, 0, 0, 0]))
        _, logits = layer.forward_with_router_logits(x())
    chosen = layer.route(logits)[1]
    expected = torch.bincount(chosen.flatten(), minlength=8)
    assert expected[:2].tolist() == [B * T, B * T]  # the bias sends every token to 0 and 1
    counts = tokens_per_expert((logits,), 2, layers=[layer])
    assert counts.tolist() == [expected.tolist()]
    assert tokens_per_expert((logits,), 2).tolist() != counts.tolist()  # the softmax's choice
    softmax_layer = MixtureOfExperts(D, F_, 8, 2)
    assert torch.equal(
        tokens_per_expert((logits,), 2, layers=[softmax_layer]), tokens_per_expert((logits,), 2)
    )
