"""latent_attention: our multi-head latent attention equals ``transformers``'
``DeepseekV3Attention`` (float32, 1e-5: theirs normalises in float32 whatever the dtype) with
q_lora_rank set and unset, both rotary layouts, YaRN with DeepSeek's mscale, over 3x YaRN's
original length; the absorbed decoding form equals the unabsorbed one in float64 (1e-12), read
whole and step by step with left padding; the model decodes in the absorbed form and reads its
prompt unabsorbed (generate() and step, growing and preallocated caches, rewind), its stepped
logits equal to the whole sequence's in float64 (1e-10) and its greedy tokens to the unabsorbed
decoding's; the cache holds only the latent and the rotary key. The configs are shared with
test_deepseek_weights (the whole model)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    yarn_apply_mscale,
)

from helpers import lm_config, raises, randomized
from transformer_tutorial.lm.cache import CacheLayout, SequenceBuffers
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.deepseek_weights import (
    DEEPSEEK,
    MLA_NAMES,
    deepseek_v3_config,
)
from transformer_tutorial.lm.grouped_attention import GroupedQueryAttention, kv_cache_bytes
from transformer_tutorial.lm.latent_attention import (
    MultiHeadLatentAttention,
    latent_cache_bytes,
    mla_softmax_scale,
)
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.pieces import make_attention
from transformer_tutorial.lm.rope_scaling import RopeScaling
from transformer_tutorial.lm.sampling import generate

B, T = 3, 24
ATOL = RTOL = 1e-5
YARN = RopeScaling(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=8,
    mscale=0.8,
    mscale_all_dim=0.7,
)
CONFIGS = {  # name: changes to config()
    "q-lora-interleaved": {},
    "q-direct-interleaved": dict(q_lora_rank=None),
    "q-lora-half-split": dict(rope_interleave=False),
    "q-direct-yarn-tied": dict(q_lora_rank=None, rope_scaling=YARN, tie_embeddings=True),
}


def config(**changes) -> LMConfig:
    """DeepSeek's choices: D = 32, 4 heads, queries through a latent of 12, key/value latent of
    16, each head 8 wide without positions + 6 rotary (interleaved), values 10 wide; the
    model's RMSNorm epsilon 0.1 (the latents' stay DeepSeek's 1e-6), 3 dense layers, 24
    positions, no dropout."""
    mla = dict(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6)
    mla |= dict(v_head_dim=10, rope_interleave=True)
    base = DEEPSEEK | dict(dropout=0.0, max_len=T, layer_norm_eps=0.1)
    return lm_config(**(base | mla | changes))


def left_padded(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (B, T) and their padding (True): row 0 left-padded by 9, row 1 by 3."""
    ids = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(seed))
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[0, :9], padding[1, :3] = True, True
    return ids, padding


def attention_pair(
    name: str, seed: int = 0
) -> tuple[MultiHeadLatentAttention, DeepseekV3Attention]:
    ours_config = config(**CONFIGS[name])
    hf_config = deepseek_v3_config(ours_config)
    hf_config._attn_implementation = "eager"
    ref = randomized(DeepseekV3Attention(hf_config, 0), seed)
    ours = make_attention(ours_config).eval()
    with torch.no_grad():
        for n, p in ours.named_parameters():
            module, kind = n.rsplit(".", 1)
            p.copy_(ref.get_parameter(f"{MLA_NAMES[module]}.{kind}"))
    return ours, ref


def their_attention(ref: DeepseekV3Attention, x: torch.Tensor) -> torch.Tensor:
    L = x.size(1)
    positions = torch.arange(L).expand(x.size(0), L)
    cos_sin = DeepseekV3RotaryEmbedding(ref.config)(x, positions)
    future = torch.full((L, L), float("-inf")).triu(1)[None, None]
    return ref(x, cos_sin, future)[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_attention_equals_deepseek_v3_attention(name):
    """T positions (3x YaRN's original length), every query."""
    ours, ref = attention_pair(name)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = their_attention(ref, x)
        assert expected.abs().max() > 0.5
        torch.testing.assert_close(ours(x), expected, atol=ATOL, rtol=RTOL)


def test_the_rotary_layout_flag_matters():
    """The same weights read with the other layout: another attention (the test above would
    fail on a port that ignores rope_interleave)."""
    ours, ref = attention_pair("q-lora-interleaved")
    ours.rotary.layout = "half_split"
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(x) - their_attention(ref, x)).abs().max() > 1e-2


def test_softmax_scale_is_deepseeks_yarn_mscale():
    for scaling in (
        None,
        YARN,
        RopeScaling(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ):
        parameters = {"rope_type": "default"} if scaling is None else scaling.to_parameters()
        expected = yarn_apply_mscale(parameters, 192**-0.5)
        assert mla_softmax_scale(192, scaling) == pytest.approx(expected, rel=1e-12)
    assert mla_softmax_scale(192, YARN) > 192**-0.5 * 1.05  # not the plain 1/√Dqk


def mla64(q_lora_rank: int | None = 12) -> MultiHeadLatentAttention:
    attention = make_attention(config(q_lora_rank=q_lora_rank))
    return randomized(attention, 3).double()


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_absorbed_equals_unabsorbed_in_float64(q_lora_rank):
    """A left-padded batch read whole, then decoded after a prompt of 5: one token at a time
    and 3 at once, each form through its own cache."""
    mla = mla64(q_lora_rank)
    x = torch.randn(B, 12, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    padding = left_padded()[1][:, :12]
    with torch.no_grad():
        unpadded = mla(x)  # one causal block: the absorbed form writes its mask out
        torch.testing.assert_close(mla(x, absorbed=True), unpadded, atol=1e-12, rtol=1e-12)
        whole = mla(x, key_padding_mask=padding)
        torch.testing.assert_close(
            mla(x, key_padding_mask=padding, absorbed=True), whole, atol=1e-12, rtol=1e-12
        )
        plain, absorbed = SequenceBuffers(mla.cache_layout), SequenceBuffers(mla.cache_layout)
        outs = {False: [], True: []}
        for start, stop in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 12)):
            for form, cache in ((False, plain), (True, absorbed)):
                out = mla(
                    x[:, start:stop],
                    key_padding_mask=padding[:, :stop],
                    cache=cache,
                    absorbed=form,
                )
                outs[form].append(out)
        real = ~padding
        for form in (False, True):
            steps = torch.cat(outs[form], dim=1)
            torch.testing.assert_close(steps[real], whole[real], atol=1e-12, rtol=1e-12)
    assert torch.equal(plain.buffers[0], absorbed.buffers[0])


def count_forms(monkeypatch) -> list[tuple[str, int, int]]:
    """From now on, every call of either form, in order: ``(form, L, S)``, L queries over S
    held positions (each layer's call one entry)."""
    calls = []
    for form, method in (("unabsorbed", "_attend"), ("absorbed", "_attend_absorbed")):
        attend = getattr(MultiHeadLatentAttention, method)

        def spy(self, q_nope, q_rope, held, *args, form=form, attend=attend):
            calls.append((form, q_nope.size(2), held.size(1)))
            return attend(self, q_nope, q_rope, held, *args)

        monkeypatch.setattr(MultiHeadLatentAttention, method, spy)
    return calls


def test_the_cheaper_form_is_absorbed_after_a_cache_for_few_new_positions():
    """At DeepSeek-V3's widths (Dc 512, Dn 128, Dr 64, Dv 128) the absorbed form costs fewer
    multiply-adds for at most 170 new positions after a long cache; never without one."""
    mla = MultiHeadLatentAttention(
        32, 1, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    assert mla.absorbs(1, 1) and mla.absorbs(4, 5) and mla.absorbs(170, 10**6)
    assert not mla.absorbs(171, 10**6) and not mla.absorbs(256, 1024)
    assert not any(mla.absorbs(n, 0) for n in (1, 8, 4096))  # the prompt, training
    # a latent narrower than half a head's key and value: absorbed whenever a cache is there
    narrow = MultiHeadLatentAttention(
        32, 1, kv_lora_rank=4, qk_nope_head_dim=8, qk_rope_head_dim=2, v_head_dim=8
    )
    assert narrow.absorbs(4096, 1) and not narrow.absorbs(4096, 0)
    mla.absorbed = False
    assert not mla.absorbs(1, 1000)


def test_generate_reads_the_prompt_unabsorbed_and_decodes_every_step_absorbed(monkeypatch):
    """3 layers: the prompt of 8 unabsorbed, then each of the 15 steps after it (the 16th
    token needs none) absorbed, with a growing or a preallocated cache."""
    model = randomized(LanguageModel(config()), 5)
    prompt = left_padded(5)[0][:, :8]
    steps = [("absorbed", 1, held) for held in range(9, T) for _ in range(3)]
    forms = count_forms(monkeypatch)
    for kind in ("growing", "preallocated"):
        forms.clear()
        generate(model, prompt, T - 8, greedy=True, cache_kind=kind)
        assert forms == [("unabsorbed", 8, 8)] * 3 + steps


STEPPED = {  # name: changes to config(): heads, rotary widths, queries, widths of the latent
    "4 heads, Dr 6, queries through a latent": {},
    "2 heads, Dr 2, queries direct": dict(n_heads=2, qk_rope_head_dim=2, q_lora_rank=None),
    "8 heads, Dr 8, half-split, YaRN": dict(
        n_heads=8, qk_rope_head_dim=8, rope_interleave=False, rope_scaling=YARN
    ),
    "1 head, Dc 6 < (Dn + Dv) / 2": dict(n_heads=1, kv_lora_rank=6, q_lora_rank=None),
}


@pytest.mark.parametrize("kind", ["growing", "preallocated"])
@pytest.mark.parametrize("name", STEPPED)
def test_stepped_logits_in_the_absorbed_form_equal_the_whole_sequence_in_float64(
    monkeypatch, name, kind
):
    """A batch left-padded by 9, 3 and 0 (positions 0-8 of row 0 padding), in float64: a prompt
    of 5 (unabsorbed), then 1, 3 and 1 new positions, 2 rewound and 4 read again, then one at a
    time to T (absorbed), within 1e-10 of the whole sequence's logits at every real position."""
    model = randomized(LanguageModel(config(**STEPPED[name])), 6).double()
    ids, padding = left_padded(6)
    cache = model.new_cache(B, kind)
    chunks = [(0, 5), (5, 6), (6, 9), (9, 10), (8, 12), *((t, t + 1) for t in range(12, T))]
    logits = {}
    with torch.no_grad():
        whole = model(ids, padding_mask=padding)  # no cache: unabsorbed
        forms = count_forms(monkeypatch)
        for start, stop in chunks:
            if start < cache.length:
                cache.rewind(cache.length - start)
            step, _ = model.step(ids[:, start:stop], cache, padding_mask=padding[:, :stop])
            logits.update({t: step[:, t - start] for t in range(start, stop)})
    stepped = torch.stack([logits[t] for t in range(T)], dim=1)  # (B, T, V)
    real = ~padding
    assert whole[real].abs().max() > 1.0
    torch.testing.assert_close(stepped[real], whole[real], atol=1e-10, rtol=1e-10)
    assert forms[:3] == [("unabsorbed", 5, 5)] * 3
    assert {form for form, _, _ in forms[3:]} == {"absorbed"}
    assert len(forms) == 3 * len(chunks) and cache.length == T


def test_greedy_tokens_equal_the_unabsorbed_decodings(monkeypatch):
    """float32, as decoding runs: 16 tokens after a prompt of 8, in the cheaper forms and with
    every layer told to stay unabsorbed."""
    model = randomized(LanguageModel(config(q_lora_rank=None)), 7)
    prompt = left_padded(7)[0][:, :8]
    forms = count_forms(monkeypatch)
    tokens = generate(model, prompt, T - 8, greedy=True)
    assert sum(form == "absorbed" for form, _, _ in forms) == 3 * 15
    for layer in model.layers:
        layer.self_attn.absorbed = False
    forms.clear()
    unabsorbed = generate(model, prompt, T - 8, greedy=True)
    assert {form for form, _, _ in forms} == {"unabsorbed"}
    assert torch.equal(tokens, unabsorbed)


def test_the_cache_holds_one_latent_and_one_rotary_key_per_position():
    mla = mla64()
    cache = SequenceBuffers(mla.cache_layout)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        mla(x[:, :4], cache=cache)
        mla(x[:, 4:], cache=cache, absorbed=True)
    expected = latent_cache_bytes(
        n_layers=1,
        batch_size=2,
        length=7,
        kv_lora_rank=16,
        qk_rope_head_dim=6,
        dtype=torch.float64,
    )
    assert cache.seen == 7 and cache.buffers[0].shape == (2, 7, 16 + 6)
    assert cache.nbytes == expected == 2 * 7 * 22 * 8
    # what multi-head attention would hold for the same heads: 2 · H · Dh per position
    assert (
        kv_cache_bytes(
            n_layers=1, batch_size=2, length=7, n_kv_heads=4, d_head=14, dtype=torch.float64
        )
        > expected
    )


def test_the_layer_calls_it_as_grouped_query_attention():
    """One call for both: the model asks nothing of which it holds but the cache it starts."""
    model = LanguageModel(config())
    assert all(isinstance(layer.self_attn, MultiHeadLatentAttention) for layer in model.layers)
    _, cache = model.step(torch.zeros(1, 3, dtype=torch.long))
    assert all(c.layout.names == ("latent",) and c.seen == 3 for c in cache.layers)
    assert not isinstance(model.layers[0].self_attn, GroupedQueryAttention)


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(q_lora_rank=-1), "q_lora_rank"),
        (dict(qk_rope_head_dim=5), "qk_rope_head_dim=5 must be even"),
        (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
        (dict(v_head_dim=None), "needs v_head_dim"),
        (dict(n_kv_heads=2), "n_kv_heads=2: attention='gqa' only; set attention='gqa'"),
        (dict(bias=True), "bias=False"),
        (dict(attention="gqa"), "attention='mla' only; set attention='mla'"),
        (dict(attention_backend="tiled"), "attention='mla' has its own: set attention='gqa'"),
        (dict(positions="learned"), "set positions='rope', partial_rotary_factor=1.0"),
    ],
)
def test_bad_configs_are_refused_by_name(changes, phrase):
    raises(lambda: config(**changes), ValueError, phrase)


def test_bad_arguments_of_the_layer_are_refused_by_name():
    sizes = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)
    for changes, phrase in (
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(qk_rope_head_dim=3), "qk_rope_head_dim=3 must be even"),
        (dict(q_lora_rank=0), "q_lora_rank"),
        (dict(softmax_scale=0.0), "softmax_scale"),
        (dict(latent_norm_eps=0.0), "latent_norm_eps"),
    ):
        raises(
            lambda c=changes: MultiHeadLatentAttention(32, 4, **(sizes | c)), ValueError, phrase
        )
    raises(
        lambda: MultiHeadLatentAttention(32, 4, **sizes, absorbed=1),
        TypeError,
        "absorbed must be True or False",
    )
    mla = MultiHeadLatentAttention(32, 4, **sizes)
    raises(lambda: mla(torch.zeros(2, 3, 31)), ValueError, "x must be (B, L, D=32)")
    padding = torch.zeros(2, 4, dtype=torch.bool)  # one position too many
    raises(
        lambda: mla(torch.zeros(2, 3, 32), key_padding_mask=padding), ValueError, "(B, seen + L)"
    )
    raises(
        lambda: latent_cache_bytes(
            n_layers=1, batch_size=1, length=1, kv_lora_rank=512, qk_rope_head_dim=64, dtype=2
        ),
        TypeError,
        "dtype must be a torch.dtype",
    )


# --- API probes (issue 42): each bad call, and what its error must say ------------------------


def _mla(**changes) -> MultiHeadLatentAttention:
    widths = dict(kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    return MultiHeadLatentAttention(16, 2, **(widths | changes))


X16 = torch.randn(1, 3, 16)
LATENT_PROBES = {
    "a cache of keys and values": (
        lambda: _mla()(X16, SequenceBuffers(CacheLayout(("k", "v"), ((2, 8),) * 2, 2))),
        TypeError,
        "cache must keep latent (B, S, 6) (the attention's cache_layout), got SequenceBuffers "
        "keeping k (B, 2, S, 8), v (B, 2, S, 8)",
    ),
    "absorbed an int": (
        lambda: _mla()(X16, absorbed=1),
        TypeError,
        "absorbed must be True or False, got 1",
    ),
    "no new positions": (
        lambda: _mla().absorbs(0, 2),
        ValueError,
        "new must be at least 1, got 0",
    ),
    "negative cached positions": (
        lambda: _mla().absorbs(1, -1),
        ValueError,
        "seen must be at least 0, got -1",
    ),
    "no rows": (
        lambda: SequenceBuffers.preallocate(_mla().cache_layout, 0, 4),
        ValueError,
        "batch_size must be at least 1, got 0",
    ),
    "integer x": (
        lambda: _mla()(X16.long()),
        TypeError,
        "x must be a floating-point tensor, got torch.int64",
    ),
    "scaling a str": (
        lambda: mla_softmax_scale(4, "yarn"),
        TypeError,
        "scaling must be a RopeScaling or None, got str",
    ),
    "dropout 1": (lambda: _mla(dropout=1.0), ValueError, "dropout must be in [0.0, 1.0), got 1.0"),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), LATENT_PROBES.values(), ids=LATENT_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
