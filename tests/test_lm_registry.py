"""lm.registry: a config's string finds its piece, which checks the fields only it reads; a new
attention is its module and one ``register`` line — the config, the layer, the model, the three
kinds of cache and ``generate`` take it unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import raises
from transformer_tutorial.lm.cache import CacheLayout
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.registry import (
    ATTENTION_KERNELS,
    ATTENTIONS,
    CACHE_KINDS,
    POSITIONS,
    ROUTERS,
    AttentionPiece,
    Piece,
    Registry,
)
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.masks import sdpa_mask


class OneHeadAttention(nn.Module):
    """A throwaway attention: one head of width D whose cache keeps each position's key and
    value side by side in one tensor ``(B, S, 2D)`` — a layout no book piece has."""

    residual_projections = ("out.weight",)

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    @property
    def cache_layout(self) -> CacheLayout:
        return CacheLayout(("kv",), ((2 * self.out.in_features,),), seq_dim=1)

    def forward(self, x, cache=None, *, position_ids=None, key_padding_mask=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, L, D) each
        kv = torch.cat([k, v], dim=-1)
        if cache is not None:
            (kv,) = cache.update(kv)  # (B, S, 2D)
        k, v = kv.chunk(2, dim=-1)
        B, L, S = x.size(0), x.size(1), k.size(1)
        allowed, causal = sdpa_mask(B, L, S, key_padding_mask, device=x.device)
        heads = (t[:, None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(*heads, attn_mask=allowed, is_causal=causal)
        return self.out(out[:, 0])


class OneHeadPiece(AttentionPiece):
    def build(self, config, rotary) -> OneHeadAttention:
        return OneHeadAttention(config.d_model)


@pytest.fixture
def one_head():
    """Registers "one_head" for the test and takes it out after."""
    ATTENTIONS.register("one_head", OneHeadPiece())  # the one line a new attention adds
    yield
    del ATTENTIONS.pieces["one_head"]


def test_a_new_attention_is_its_module_and_one_register_line(one_head):
    config = LMConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=2, max_len=20, dropout=0.0)
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(**{**config.__dict__, "attention": "one_head"})).eval()
    model = model.double()
    assert all(isinstance(layer.self_attn, OneHeadAttention) for layer in model.layers)
    ids = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(1))
    whole = model(ids)
    options = {"paged": dict(n_blocks=6, block_size=4)}
    for kind in CACHE_KINDS:
        cache = model.new_cache(2, kind, **options.get(kind, {}))
        first, _ = model.step(ids[:, :5], cache)
        rest = [model.step(ids[:, t : t + 1], cache)[0] for t in range(5, 9)]
        torch.testing.assert_close(torch.cat([first, *rest], 1), whole, rtol=1e-12, atol=1e-12)
    want = generate(model, ids[:, :3], 8, greedy=True, use_cache=False)
    for kind in ("growing", "preallocated"):
        assert torch.equal(generate(model, ids[:, :3], 8, greedy=True, cache_kind=kind), want)
    # its config refuses the other pieces' fields, and rotary positions it has no hook for
    raises(
        lambda: LMConfig(vocab_size=30, attention="one_head", n_kv_heads=2),
        ValueError,
        "n_kv_heads=2: attention='gqa' only; set attention='gqa'",
    )
    raises(
        lambda: LMConfig(vocab_size=30, attention="one_head", positions="rope"),
        ValueError,
        "attention='one_head' has no hook for them",
    )


def test_the_books_registries_hold_the_books_pieces():
    assert sorted(ATTENTIONS) == ["gqa", "mha", "mla"]
    assert sorted(POSITIONS) == ["learned", "rope", "sinusoidal"]
    assert sorted(ATTENTION_KERNELS) == ["sdpa", "tiled"]
    assert sorted(ROUTERS) == ["sigmoid", "softmax"]
    assert sorted(CACHE_KINDS) == ["growing", "paged", "preallocated"]
    assert "gqa" in ATTENTIONS and "GQA" not in ATTENTIONS and 3 not in ATTENTIONS


def test_a_registry_refuses_a_taken_name_or_a_non_piece():
    registry = Registry("flavour")
    piece = registry.register("plain", Piece())
    assert registry["plain"] is piece and len(registry) == 1 and "plain" in repr(registry)
    raises(lambda: registry.register("plain", Piece()), ValueError, "flavour='plain' is already")
    raises(lambda: registry.register("", Piece()), TypeError, "a flavour name must be a non-empty")
    raises(lambda: registry.register("odd", object()), TypeError, "of kind Piece, got <object")
    raises(lambda: ATTENTIONS.register("bare", Piece()), TypeError, "of kind AttentionPiece")
    raises(lambda: registry["sour"], ValueError, "flavour must be one of ['plain'], got 'sour'")
    raises(lambda: registry[None], ValueError, "flavour must be one of ['plain'], got None")


def test_importing_the_config_loads_no_piece_until_a_name_is_looked_up():
    import subprocess
    import sys

    code = (
        "import sys, transformer_tutorial.lm.config as c; "
        "before = 'transformer_tutorial.lm.latent_attention' in sys.modules; "
        "c.LMConfig(vocab_size=5, d_model=8, n_heads=2); "
        "print(before, 'transformer_tutorial.lm.latent_attention' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_a_registry_whose_module_fails_to_import_tries_again_and_says_why():
    registry = Registry("flavour", ("transformer_tutorial.lm.no_such_module",))
    for _ in range(2):  # not left half-loaded: the second lookup fails the same way
        raises(lambda: registry["plain"], ModuleNotFoundError, "no_such_module")


def test_an_attention_without_a_rotary_hook_or_a_checkpoint_family_is_refused_by_name(one_head):
    from transformer_tutorial.lm.pretrained import model_type

    config = LMConfig(vocab_size=30, d_model=16, n_heads=2, attention="one_head")
    raises(lambda: model_type(config), ValueError, "attention='one_head' has no checkpoint family")
    raises(
        lambda: LMConfig(vocab_size=30, attention="one_head", attention_backend="tiled"),
        ValueError,
        "attention='one_head' has its own: set attention='gqa'",
    )
