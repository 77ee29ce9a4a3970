"""language_model: the model is causal, cached steps equal the whole sequence, right padding
changes nothing, the next-token loss is the shifted cross-entropy, a tiny model overfits, and
bad configs are refused. (The layer alone: test_lm_layer.py; equality with GPT-2:
test_lm_gpt2_weights.py, with Llama and Qwen3: test_lm_hf_weights.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import raises
from transformer_tutorial.embeddings import SinusoidalPositionalEncoding, TokenEmbedding
from transformer_tutorial.feed_forward import SwiGLU
from transformer_tutorial.layers import FeedForward
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.grouped_attention import GroupedQueryAttention
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.lm.pieces import PositionsInAttention
from transformer_tutorial.norms import RMSNorm

B, T, V, D, H, D_FF = 3, 9, 23, 16, 4, 32
ATOL = 1e-5
MODERN = dict(LLAMA, dropout=0.0)  # Llama's choices at the tiny sizes below
# Chapter 17's choices, from GPT-2 to Qwen3; the windows are shorter than T.
CHOICES = {
    "gpt2": {},
    "rms-swiglu": dict(norm="rms", activation="swiglu"),
    "gqa-as-mha": dict(attention="gqa", bias=True),
    "llama": dict(MODERN, n_kv_heads=2),
    "mqa-post-norm": dict(MODERN, n_kv_heads=1, norm_first=False),
    "qwen3-window-3": dict(QWEN3, n_kv_heads=2, window=3),
    "window-1": dict(MODERN, window=1),
    "head-width-6": dict(MODERN, d_head=6, n_kv_heads=2),
}


def tiny(**changes) -> LMConfig:
    sizes = dict(vocab_size=V, d_model=D, n_heads=H, n_layers=2, d_ff=D_FF, max_len=12)
    return LMConfig(**(sizes | dict(dropout=0.0) | changes))


def model(seed: int = 0, **changes) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(tiny(**changes)).eval()


def ids(seed: int = 1, shape: tuple[int, int] = (B, T)) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"norm_first": False},
        {"positions": "sinusoidal", "scale_embeddings": True},
        *CHOICES.values(),
    ],
    ids=["gpt2", "post-norm", "paper-positions", *(f"ch17-{name}" for name in CHOICES)],
)
def test_logits_do_not_depend_on_later_tokens(changes):
    lm = model(**changes)
    a = ids()
    b = a.clone()
    b[:, 5:] = (b[:, 5:] + 1) % V  # change the future of position 4
    with torch.no_grad():
        la, lb = lm(a), lm(b)
    torch.testing.assert_close(la[:, :5], lb[:, :5], atol=0, rtol=0)
    assert not torch.allclose(la[:, 5:], lb[:, 5:])


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_cached_steps_equal_the_whole_sequence(norm_first, positions):
    lm = model(norm_first=norm_first, positions=positions)
    x = ids()
    with torch.no_grad():
        whole = lm(x)
        first, cache = lm.step(x[:, :4])  # a prompt of 4, then 2, then one at a time
        second, cache = lm.step(x[:, 4:6], cache)
        rest = []
        for t in range(6, T):
            logits, cache = lm.step(x[:, t : t + 1], cache)
            rest.append(logits)
    stepped = torch.cat([first, second, *rest], dim=1)
    torch.testing.assert_close(stepped, whole, atol=ATOL, rtol=ATOL)
    assert cache.length == T and cache.layers[0].buffers[0].shape == (B, H, T, D // H)


def _stepped(lm: LanguageModel, x: torch.Tensor, padding_mask=None) -> torch.Tensor:
    """Logits of a prompt of 4, then 2 positions, then one at a time, each step from the cache
    the one before returned."""
    masks = (None,) * 4 if padding_mask is None else [padding_mask[:, :t] for t in (4, 6, 7)]
    first, cache = lm.step(x[:, :4], padding_mask=masks[0])
    second, cache = lm.step(x[:, 4:6], cache, padding_mask=masks[1])
    rest = []
    for t in range(6, x.size(1)):
        mask = None if padding_mask is None else padding_mask[:, : t + 1]
        logits, cache = lm.step(x[:, t : t + 1], cache, padding_mask=mask)
        rest.append(logits)
    return torch.cat([first, second, *rest], dim=1)


@pytest.mark.parametrize("changes", CHOICES.values(), ids=CHOICES.keys())
def test_cached_steps_equal_the_whole_sequence_with_every_choice(changes):
    """Also past a sliding window (3 and 1 < T = 9): the cache keeps only what a later query
    sees, and the positions keep counting."""
    lm = model(**changes)
    x = ids()
    with torch.no_grad():
        whole, stepped = lm(x), _stepped(lm, x)
        _, cache = lm.step(x)
    torch.testing.assert_close(stepped, whole, atol=ATOL, rtol=ATOL)
    window = changes.get("window")
    held = T if window is None else window - 1
    assert cache.length == T and all(layer.buffers[0].size(2) == held for layer in cache.layers)


MLA = dict(
    MODERN, attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4
)
KIND_CHOICES = {**CHOICES, "mla": MLA}


@pytest.mark.parametrize("kind", ["growing", "preallocated"])
@pytest.mark.parametrize("changes", KIND_CHOICES.values(), ids=KIND_CHOICES.keys())
def test_every_cache_kind_steps_as_the_whole_sequence_and_rewinds(changes, kind):
    """The caller picks the kind; the cache changes in place (step returns the same object),
    and after rewinding the last positions, stepping them again gives the same logits."""
    lm = model(**changes)
    x = ids()
    cache = lm.new_cache(B, kind)
    with torch.no_grad():
        whole = lm(x)
        first, same = lm.step(x[:, :5], cache)
        assert same is cache and cache.length == 5
        rest = torch.cat([lm.step(x[:, t : t + 1], cache)[0] for t in range(5, T)], 1)
        torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=ATOL, rtol=ATOL)
        if changes.get("window") is not None and kind == "growing":
            raises(lambda: cache.rewind(2), ValueError, "has dropped")
            return
        cache.rewind(3)
        assert cache.length == T - 3
        again = lm.step(x[:, T - 3 :], cache)[0]
    torch.testing.assert_close(again, whole[:, T - 3 :], atol=ATOL, rtol=ATOL)
    assert cache.length == T


def test_a_preallocated_cache_is_allocated_once_in_the_models_dtype():
    lm = model(**CHOICES["llama"]).double()
    cache = lm.new_cache(B, "preallocated", max_len=T)
    layer = cache.layers[0]
    k = layer.buffers[0]
    assert k.shape == (B, 2, T, D // H) and k.dtype == torch.float64
    before = k.data_ptr()
    with torch.no_grad():
        lm.step(ids(), cache)
    assert layer.buffers[0].data_ptr() == before and cache.length == T
    raises(lambda: lm.step(ids(shape=(B, 1)), cache), ValueError, "preallocate a larger max_len")
    raises(lambda: lm.new_cache(B, "pinned"), ValueError, "kind must be one of")
    raises(lambda: lm.new_cache(B, "paged"), ValueError, "needs n_blocks and block_size")
    raises(lambda: lm.new_cache(B, "growing", n_blocks=4), TypeError, "takes no n_blocks")
    raises(lambda: lm.new_cache(0), ValueError, "batch_size must be at least 1")


@pytest.mark.parametrize("name", ["llama", "qwen3-window-3"])
def test_a_left_padded_row_gives_the_logits_of_the_row_alone(name):
    """With rotary positions and a padding mask, padding on the left changes no real position,
    whole or decoded step by step with the cache; without the mask it does."""
    lm = model(**CHOICES[name])
    x = ids(shape=(2, T))
    pads = 3
    padded = torch.cat([torch.zeros(2, pads, dtype=torch.long), x[:, : T - pads]], dim=1)
    padded[1] = x[1]  # row 1 unpadded: the batch mixes both
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, :pads] = True
    with torch.no_grad():
        alone = lm(x[:1, : T - pads])
        whole = lm(padded, padding_mask=mask)
        stepped = _stepped(lm, padded, mask)
        unmasked = lm(padded)
    for got in (whole, stepped):
        assert got.isfinite().all()
        torch.testing.assert_close(got[:1, pads:], alone, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(got[1:], lm(x[1:]), atol=ATOL, rtol=ATOL)
    assert (unmasked[:1, pads:] - alone).abs().max() > 1e-3


def test_gqa_with_as_many_kv_heads_is_mha():
    """The switch from chapter 4's attention to chapter 16's changes no number: with H key/value
    heads, the same biases and learned positions, copied weights give the same logits."""
    mha, gqa = model(), model(seed=1, attention="gqa", bias=True)
    gqa.load_state_dict(mha.state_dict())
    assert isinstance(gqa.layers[0].self_attn, GroupedQueryAttention)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), atol=ATOL, rtol=ATOL)


def test_llama_choices_build_todays_pieces():
    lm = model(**CHOICES["llama"])
    layer = lm.layers[0]
    assert isinstance(layer.norm1, RMSNorm) and isinstance(lm.norm, RMSNorm)
    assert isinstance(layer.ff, SwiGLU) and isinstance(lm.positions, PositionsInAttention)
    attn = layer.self_attn
    assert (attn.n_kv_heads, attn.k_proj.out_features, attn.q_norm) == (2, 2 * D // H, None)
    assert not [n for n, _ in lm.named_parameters() if n.endswith("bias")]
    assert lm.lm_head.weight is not lm.embed.weight
    # one rotary hook for the model, its tables built once and shared by every layer
    assert [k for k in dict(lm.named_buffers()) if "rotary" in k] == [
        "rotary.rotary.cos",
        "rotary.rotary.sin",
    ]
    assert all(layer.self_attn.rotary is lm.rotary for layer in lm.layers)
    assert not any("rotary" in k for k in lm.state_dict())  # formulas, not weights
    qwen3 = model(**CHOICES["qwen3-window-3"]).layers[0].self_attn
    assert isinstance(qwen3.q_norm, RMSNorm) and qwen3.window == 3
    # the feed-forward's down_proj writes into the stream: initialised as GPT-2's linear2
    big = LanguageModel(tiny(**MODERN, d_model=64, d_ff=256, n_layers=8, vocab_size=500))
    down = torch.cat([layer.ff.down_proj.weight.flatten() for layer in big.layers]).std()
    assert math.isclose(down.item(), 0.02 / math.sqrt(16), rel_tol=0.05)


def test_rotary_tables_move_with_the_model():
    lm = model(**CHOICES["llama"]).to(torch.float64)
    assert lm.layers[0].self_attn.rotary.rotary.cos.dtype == torch.float64
    x = ids()
    with torch.no_grad():
        assert lm(x).dtype == torch.float64


def test_right_padding_changes_no_real_position():
    lm = model()
    short = ids(shape=(1, 5))
    padded = torch.cat([short, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(lm(padded)[:, :5], lm(short), atol=ATOL, rtol=ATOL)


def test_paper_front_end_is_chapter_one_and_two():
    """scale_embeddings + sinusoidal positions: the embeddings of chapters 1 and 2."""
    lm = model(positions="sinusoidal", scale_embeddings=True)
    token = TokenEmbedding(V, D)
    token.embedding.weight.data.copy_(lm.embed.weight)
    x = ids()
    expected = SinusoidalPositionalEncoding(D, 12)(token(x))
    got = lm.positions(lm.embed(x) * lm.embed_scale)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


def test_feed_forward_takes_gpt2_tanh_gelu_and_no_bias():
    ff = FeedForward(D, D_FF, activation=lambda x: F.gelu(x, approximate="tanh"), bias=False)
    assert ff.linear1.bias is None and ff.linear2.bias is None
    x = torch.randn(B, T, D)
    expected = ff.linear2.weight @ F.gelu(ff.linear1.weight @ x[..., None], approximate="tanh")
    torch.testing.assert_close(ff(x), expected.squeeze(-1), atol=ATOL, rtol=ATOL)
    lm = model(bias=False, activation="gelu_tanh")
    biases = [n for n, _ in lm.named_parameters() if n.endswith("bias")]
    assert biases and all("norm" in n for n in biases), biases  # the norms keep theirs


def test_tied_output_layer_is_the_embedding_and_counted_once():
    tied, untied = model(), model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.num_parameters() - tied.num_parameters() == V * D


def test_initialisation_scales_the_residual_projections_down():
    lm = LanguageModel(tiny(d_model=64, d_ff=256, n_layers=8, vocab_size=500))
    out_std = torch.cat([layer.self_attn.out_proj.weight.flatten() for layer in lm.layers]).std()
    q_std = torch.cat([layer.self_attn.q_proj.weight.flatten() for layer in lm.layers]).std()
    assert math.isclose(q_std.item(), 0.02, rel_tol=0.05)
    assert math.isclose(out_std.item(), 0.02 / math.sqrt(16), rel_tol=0.05)
    assert all(layer.norm1.weight.eq(1).all() for layer in lm.layers)


class Halves(torch.nn.Module):
    """A feed-forward piece no earlier chapter knew, naming its own residual projection."""

    residual_projections = ("back.weight",)

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.there, self.back = torch.nn.Linear(d_model, 512), torch.nn.Linear(512, d_model)

    def forward(self, x):
        return self.back(self.there(x))


def test_a_new_piece_declares_its_residual_projection_and_gets_the_scaling():
    """Initialisation reads each piece's residual_projections, not a list of names: a piece
    added later (here a feed-forward of another name) gets GPT-2's scaling with no change to
    the model; the MoE experts' stacked down_proj gets it too."""
    lm = LanguageModel(tiny(d_model=64, n_layers=8, vocab_size=500))
    for layer in lm.layers:
        layer.ff = Halves(64)
    lm.reset_parameters()
    back = torch.cat([layer.ff.back.weight.flatten() for layer in lm.layers]).std()
    there = torch.cat([layer.ff.there.weight.flatten() for layer in lm.layers]).std()
    assert math.isclose(back.item(), 0.02 / math.sqrt(16), rel_tol=0.05)
    assert math.isclose(there.item(), 0.02, rel_tol=0.05)
    moe = dict(MODERN, n_experts=4, n_experts_per_token=2, moe_d_ff=64)
    experts = LanguageModel(tiny(**moe, d_model=64, n_layers=8, vocab_size=500))
    down = torch.cat([layer.ff.experts.down_proj.flatten() for layer in experts.layers]).std()
    up = torch.cat([layer.ff.experts.up_proj.flatten() for layer in experts.layers]).std()
    assert math.isclose(down.item(), 0.02 / math.sqrt(16), rel_tol=0.05)
    assert math.isclose(up.item(), 0.02, rel_tol=0.05)


def test_next_token_loss_is_shifted_cross_entropy_ignoring_padding():
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(3))
    x = ids()
    x[0, 6:] = 0
    by_hand = [
        -logits[b, t].log_softmax(-1)[x[b, t + 1]]
        for b in range(B)
        for t in range(T - 1)
        if x[b, t + 1] != 0
    ]
    got = next_token_loss(logits, x, ignore_index=0)
    torch.testing.assert_close(got, torch.stack(by_hand).mean(), atol=ATOL, rtol=ATOL)
    assert not torch.isclose(next_token_loss(logits, x), got)


def test_a_tiny_model_learns_a_sentence_by_heart():
    torch.manual_seed(0)
    lm = LanguageModel(tiny(dropout=0.1))
    sentence = ids(shape=(1, 12)).expand(4, -1)
    start = next_token_loss(lm(sentence), sentence).item()
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    for _ in range(60):
        loss = next_token_loss(lm(sentence), sentence)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    lm.eval()
    with torch.no_grad():
        end = next_token_loss(lm(sentence), sentence).item()
    assert start > 0.9 * math.log(V) and end < 0.05, (start, end)


@pytest.mark.parametrize(
    ("changes", "error", "phrase"),
    [
        ({"d_model": 18}, ValueError, "d_model=18 must be divisible by n_heads=4"),
        ({"n_layers": 0}, ValueError, "n_layers must be at least 1"),
        ({"dropout": 1.0}, ValueError, "dropout must be in [0.0, 1.0)"),
        ({"activation": "swish"}, ValueError, "activation must be one of"),
        ({"norm": "rmsnorm"}, ValueError, "norm must be one of ['layer', 'rms']"),
        ({"positions": "alibi"}, ValueError, "one of ['learned', 'rope', 'sinusoidal']"),
        ({"attention": "mqa"}, ValueError, "attention must be one of ['gqa', 'mha', 'mla']"),
        (
            {"positions": "rope"},
            ValueError,
            "positions='rope' turns queries and keys inside the attention; attention='mha' has "
            "no hook for them: set attention='gqa'",
        ),
        (
            {"n_kv_heads": 2, "window": 4},
            ValueError,
            "n_kv_heads=2, window=4: attention='gqa' only",
        ),
        ({"attention": "gqa", "n_kv_heads": 3}, ValueError, "n_kv_heads=3 must divide n_heads=4"),
        ({"attention": "gqa", "n_kv_heads": 0}, ValueError, "n_kv_heads must be at least 1"),
        ({**MODERN, "d_head": 5}, ValueError, "head width 5 must be even for rotary"),
        ({"rope_base": 1.0}, ValueError, "rope_base must be greater than 1"),
        ({"rope_base": 5e5}, ValueError, "rope_base=500000.0: positions='rope' only"),
        ({"qk_norm": 1}, TypeError, "qk_norm must be True or False"),
        ({"bias": 1}, TypeError, "bias must be True or False"),
        ({"d_model": 15, "n_heads": 3, "positions": "sinusoidal"}, ValueError, "must be even"),
    ],
)
def test_bad_configs_are_refused(changes, error, phrase):
    raises(lambda: tiny(**changes), error, phrase)


@pytest.mark.parametrize(
    ("call", "error", "phrase"),
    [
        (lambda lm: lm(torch.zeros(2, 13, dtype=torch.long)), ValueError, "exceed max_len=12"),
        (lambda lm: lm(torch.full((1, 3), V)), ValueError, f"valid ids are 0 to {V - 1}"),
        (lambda lm: lm(torch.zeros(1, 3)), ValueError, "must be integer token ids"),
        (lambda lm: lm(torch.zeros(3, dtype=torch.long)), ValueError, "of shape (B, T)"),
        (
            lambda lm: lm.step(
                torch.zeros(1, 3, dtype=torch.long), lm.step(ids(shape=(1, 10)))[1]
            ),
            ValueError,
            "10 cached + 3 new positions exceed max_len=12",
        ),
        (
            lambda lm: next_token_loss(torch.zeros(2, 3, V), torch.zeros(2, 4, dtype=torch.long)),
            ValueError,
            "logits must be (B, T, V)",
        ),
        (
            lambda lm: next_token_loss(torch.zeros(2, 1, V), torch.zeros(2, 1, dtype=torch.long)),
            ValueError,
            "at least 2 positions",
        ),
    ],
)
def test_bad_inputs_are_refused(call, error, phrase):
    raises(lambda: call(model()), error, phrase)


def test_bad_padding_masks_are_refused():
    x = ids()
    raises(lambda: model()(x, padding_mask=x == 0), ValueError, "padding_mask needs positions=")
    llama = model(**MODERN)
    wrong_shape = "padding_mask has shape"
    raises(lambda: llama(x, padding_mask=x[:, 1:] == 0), ValueError, wrong_shape)
    raises(lambda: llama(x, padding_mask=(x == 0).long()), TypeError, "must be a bool tensor")


@pytest.mark.parametrize("changes", [CHOICES["llama"], dict(QWEN3, n_kv_heads=1, d_head=6)])
def test_the_tiled_backend_gives_the_models_numbers_and_gradients(changes):
    """Chapter 22's attention as the model's backend: in float64 the logits (whole, stepped
    with a cache, left-padded) and every gradient equal the fused kernel's."""
    fused = model(**changes).double()
    tiled = LanguageModel(tiny(**changes, attention_backend="tiled")).double()
    tiled.load_state_dict(fused.state_dict())
    x = ids()
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, :3] = True  # row 0 padded on the left
    for lm in (fused, tiled):
        next_token_loss(lm(x, padding_mask=pad), x).backward()
    torch.testing.assert_close(tiled(x), fused(x), rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        torch.testing.assert_close(_stepped(tiled, x), _stepped(fused, x), rtol=1e-10, atol=1e-10)
    for (name, a), b in zip(tiled.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12, msg=name)
    raises(
        lambda: tiny(**(changes | dict(attention_backend="tiled", dropout=0.1))),
        ValueError,
        "dropout=0",
    )
    raises(lambda: tiny(attention_backend="flash"), ValueError, "attention_backend must be one of")


def test_a_cache_that_does_not_fit_is_refused_before_any_layer_writes():
    lm = model(**CHOICES["llama"]).eval()
    cache = lm.new_cache(3, "preallocated")
    with torch.no_grad():
        raises(
            lambda: lm.step(ids(shape=(1, 4)), cache), ValueError, "holds [3] rows and ids has 1"
        )
        assert [layer.seen for layer in cache.layers] == [0] * len(lm.layers)  # nothing written
        lm.step(ids(shape=(3, 4)), cache)
        deeper = LanguageModel(tiny(**CHOICES["llama"], n_layers=3))
        raises(lambda: deeper.step(ids(shape=(3, 1)), cache), ValueError, "each of the model's 3")
        latent = LanguageModel(tiny(**MLA))
        raises(lambda: latent.step(ids(shape=(3, 1)), cache), ValueError, "keeps latent (B, S, ")
    raises(
        lambda: lm.new_cache(1, "preallocated", max_len=T + 99), ValueError, "exceeds the model"
    )


def test_reset_parameters_restores_gains_and_the_rotary_tables_after_to_empty():
    """The meta-device recipe (FSDP at scale): built without memory, then to_empty, then
    reset_parameters: norms' gains 1 and rotary tables equal to a model built normally."""
    config = tiny(**CHOICES["qwen3-window-3"])
    with torch.device("meta"):
        lazy = LanguageModel(config)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    built = LanguageModel(config)
    assert all(layer.norm1.weight.eq(1).all() for layer in lazy.layers)
    assert all(layer.self_attn.q_norm.weight.eq(1).all() for layer in lazy.layers)
    assert torch.equal(lazy.rotary.rotary.cos, built.rotary.rotary.cos)
    assert torch.equal(lazy.rotary.rotary.sin, built.rotary.rotary.sin)


DEEPSEEK_MOE = dict(MODERN, n_experts=4, n_experts_per_token=2, router="sigmoid", n_group=2)


@pytest.mark.parametrize("changes", [dict(positions="sinusoidal"), DEEPSEEK_MOE])
def test_reset_parameters_computes_every_buffer_again(changes):
    """Every buffer after to_empty + reset_parameters equals a model's built normally: the
    sinusoidal table, DeepSeek's correction bias (zeros) as well as the rotary tables."""
    config = tiny(**changes)
    with torch.device("meta"):
        lazy = LanguageModel(config)
    lazy.to_empty(device="cpu")
    for buffer in lazy.buffers():  # garbage, whatever to_empty left
        buffer.fill_(7.0)
    lazy.reset_parameters()
    built = dict(LanguageModel(config).named_buffers())
    assert built and all(torch.equal(b, built[name]) for name, b in lazy.named_buffers())


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

MODEL_PROBES = {
    "config a dict": (
        lambda: LanguageModel({"vocab_size": 3}),
        TypeError,
        "config must be an LMConfig, got dict",
    ),
    "ids a list (step)": (
        lambda: model().step([[1, 2]]),
        TypeError,
        "ids must be a Tensor (B, T), got list",
    ),
    "ids a list (forward)": (
        lambda: model()([[1, 2]]),
        TypeError,
        "ids must be a Tensor, got list",
    ),
    "cache a list": (
        lambda: model().step(ids(), [1]),
        ValueError,
        "cache must be an LMCache with one cache for each of the model's",
    ),
    "check_ids an int": (
        lambda: model().step(ids(), check_ids=1),
        TypeError,
        "check_ids must be True or False, got 1",
    ),
    "float targets": (
        lambda: next_token_loss(torch.randn(1, 3, 5), torch.tensor([[1.0, 2.0, 3.0]])),
        TypeError,
        "ids must be an integer tensor, got torch.float32",
    ),
    "integer logits": (
        lambda: next_token_loss(torch.ones(1, 3, 5, dtype=torch.long), torch.ones(1, 3).long()),
        TypeError,
        "logits must be a floating-point tensor, got torch.int64",
    ),
    "ignore_index a float": (
        lambda: next_token_loss(torch.randn(1, 3, 5), torch.ones(1, 3).long(), ignore_index=1.5),
        TypeError,
        "ignore_index must be an int, got 1.5",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), MODEL_PROBES.values(), ids=MODEL_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
