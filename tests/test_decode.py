"""Chapter 11, decoding: KV cache == recompute, batched == one by one, min_len, beam size 1 ==
greedy, a wide beam finds the true maximum, finished hypotheses stay finished, translating text
(order, mode, budget) and BLEU; and bad inputs: every argument of the decoders, of
``translate_sentences`` and of ``bleu`` refused with a message that says what is wrong."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from helpers import raises
from transformer_tutorial.checkpoint import load_model
from transformer_tutorial.decode import (
    EXTRA_DECODE_TOKENS,
    beam_search,
    bleu,
    greedy_decode,
    length_penalty,
    looping,
    strip_eos,
    translate_sentences,
)
from transformer_tutorial.model import Transformer, TransformerConfig

PAD, BOS, EOS = 0, 1, 2
IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)


def tiny_model(
    vocab_size: int = 12, seed: int = 0, sharpen: float = 4.0, max_len: int = 32
) -> Transformer:
    """A random one-layer pre-norm Transformer whose output layer is scaled up, so that its
    choices are clear-cut."""
    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size,
        vocab_size,
        d_model=16,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
        d_ff=32,
        dropout=0.0,
        max_len=max_len,
        norm_first=True,
    )
    model = Transformer(config).eval()
    with torch.no_grad():
        model.generator.weight.mul_(sharpen)
    return model


def random_src(vocab_size: int, lengths: list[int], seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(3, vocab_size, (n,), generator=g)
    return src


@pytest.mark.parametrize("min_len", [0, 16])
def test_greedy_kv_cache_equals_recompute(min_len):
    """Also over 16 forced steps (``min_len``), as chapter 11 times it."""
    model = tiny_model()
    src = random_src(12, [5, 3, 7, 1])
    kwargs = dict(max_len=16, min_len=min_len, **IDS)
    cached = greedy_decode(model, src, use_cache=True, **kwargs)
    recomputed = greedy_decode(model, src, use_cache=False, **kwargs)
    assert torch.equal(cached, recomputed)
    if min_len:
        assert cached.shape == (4, 16)


def eos_loving_model() -> Transformer:
    """A random model whose output layer prefers <eos> at every step."""
    model = tiny_model(10, sharpen=1.0)
    with torch.no_grad():
        model.generator.bias[EOS] = 50.0
    return model


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_min_len_rules_out_eos_until_then(use_cache):
    model = eos_loving_model()
    src = torch.tensor([[5, 6, 7], [8, 9, PAD]])
    ids = dict(**IDS, use_cache=use_cache)
    assert greedy_decode(model, src, max_len=8, **ids).tolist() == [[EOS], [EOS]]
    out = greedy_decode(model, src, max_len=8, min_len=4, **ids)
    assert out.shape == (2, 5) and (out[:, :4] != EOS).all() and (out[:, 4] == EOS).all()
    exactly = greedy_decode(model, src, max_len=6, min_len=6, **ids)
    assert exactly.shape == (2, 6) and (exactly != EOS).all()


def test_greedy_batched_equals_one_by_one_and_stops_at_eos():
    model = tiny_model(seed=3)
    src = random_src(12, [6, 2, 4], seed=5)
    batch = greedy_decode(model, src, max_len=10, **IDS)
    for row in range(src.size(0)):
        alone = greedy_decode(
            model, src[row : row + 1, : int((src[row] != PAD).sum())], max_len=10, **IDS
        )[0]
        assert batch[row, : alone.numel()].tolist() == alone.tolist()
        assert (batch[row, alone.numel() :] == PAD).all()
        tokens = batch[row].tolist()
        if EOS in tokens:  # after the first <eos> nothing but padding
            assert all(t == PAD for t in tokens[tokens.index(EOS) + 1 :])


def test_beam_size_one_equals_greedy():
    model = tiny_model(seed=7)
    src = random_src(12, [5, 3, 6, 2], seed=2)
    greedy = greedy_decode(model, src, max_len=9, **IDS)
    beam, _ = beam_search(model, src, beam_size=1, max_len=9, alpha=0.6, **IDS)
    assert torch.equal(beam, greedy)


def sequence_log_probs(
    model: Transformer, src: torch.Tensor, hyps: list[list[int]]
) -> list[float]:
    """log p(ys | src) of each hypothesis by teacher forcing (no cache); src is one sentence
    ``(1, S)``."""
    width = max(len(ys) for ys in hyps)
    tgt = torch.tensor(
        [[BOS, *ys[:-1]] + [3] * (width - len(ys)) for ys in hyps]
    )  # filler after the end
    with torch.no_grad():
        memory = model.encode(src).expand(len(hyps), -1, -1)
        logp = model.decode(
            tgt,
            memory,
            memory_key_padding_mask=(src == PAD).expand(len(hyps), -1),
            tgt_key_padding_mask=torch.zeros_like(tgt, dtype=torch.bool),
        ).log_softmax(-1)
    return [
        float(logp[i, torch.arange(len(ys)), torch.tensor(ys)].sum()) for i, ys in enumerate(hyps)
    ]


def all_hypotheses(vocab_size: int, max_len: int):
    """Every finished sequence: ends at its first <eos>, or runs to max_len."""
    for length in range(1, max_len + 1):
        for ys in itertools.product(range(vocab_size), repeat=length):
            if EOS not in ys[:-1] and (ys[-1] == EOS or length == max_len):
                yield list(ys)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_wide_beam_finds_the_true_maximum(alpha):
    vocab_size, max_len = 5, 3
    model = tiny_model(vocab_size, seed=11, sharpen=2.0)
    src = random_src(vocab_size, [3, 1, 2], seed=4)
    tokens, scores = beam_search(
        model, src, beam_size=vocab_size**max_len, max_len=max_len, alpha=alpha, **IDS
    )
    for row in range(src.size(0)):
        one = src[row : row + 1, : int((src[row] != PAD).sum())]
        hyps = list(all_hypotheses(vocab_size, max_len))
        scored = [
            (lp / length_penalty(len(ys), alpha), ys)
            for lp, ys in zip(sequence_log_probs(model, one, hyps), hyps, strict=True)
        ]
        best_score, best_ys = max(scored)
        assert scores[row].item() == pytest.approx(best_score, abs=1e-5)
        assert tokens[row, : len(best_ys)].tolist() == best_ys


class MarkovCache:
    """A cache with nothing to hold: the toy model below looks only at the newest token."""

    def reorder(self, index: torch.Tensor) -> MarkovCache:
        return self


class MarkovModel(nn.Module):
    """A hand-built stand-in with the Transformer's decoding interface: the next token's logits
    depend on the previous token only, through a fixed table."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def encode(self, src, src_key_padding_mask=None):
        return torch.zeros(*src.shape, 1)

    def init_cache(self, memory, memory_key_padding_mask=None):
        return MarkovCache()

    def decode_step(self, tgt, cache):
        return self.table[tgt], cache  # (B, 1, V)


def test_finished_hypotheses_are_never_extended():
    # After <bos>: <eos> or "a", half and half. After <eos> the model would say "a" for sure,
    # so a search that kept extending the finished "<eos>" would reach "<eos> a a", whose
    # length penalty (alpha = 1) makes it score better than any true hypothesis.
    no = -30.0
    table = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # after <pad>
            [no, no, 0.0, 0.0],  # after <bos>
            [no, no, no, 10.0],  # after <eos>
            [no, no, 0.0, 0.0],  # after "a"
        ]
    )
    tokens, scores = beam_search(
        MarkovModel(table), torch.tensor([[3]]), beam_size=2, max_len=3, alpha=1.0, **IDS
    )
    assert tokens.tolist() == [[EOS]]
    assert scores.item() == pytest.approx(math.log(0.5))


def test_beam_search_returns_eos_then_padding_and_consistent_scores():
    model = tiny_model(seed=5)
    src = random_src(12, [4, 6, 2], seed=9)
    tokens, scores = beam_search(model, src, beam_size=4, max_len=8, alpha=0.6, **IDS)
    for row in range(src.size(0)):
        ys = tokens[row].tolist()
        if EOS in ys:
            ys = ys[: ys.index(EOS) + 1]
        one = src[row : row + 1, : int((src[row] != PAD).sum())]
        expected = sequence_log_probs(model, one, [ys])[0] / length_penalty(len(ys), 0.6)
        assert scores[row].item() == pytest.approx(expected, abs=1e-5)


def test_strip_eos():
    assert strip_eos([5, 6, EOS, PAD]) == [5, 6]
    assert strip_eos([5, 6]) == [5, 6]


@pytest.mark.parametrize(
    ("text", "loops"),
    [
        ("A bodysuit is running across ligigigigigigigigigig on a white fence.", True),  # "ig"
        ("A dog dog dog runs.", True),
        ("A Dog, dog; DOG runs.", True),  # a word three times, whatever the case and marks
        ("Two men on a tononononon.", True),  # "on" four times
        ("Aaaah, a dog.", True),  # one letter four times
        ("A man in an orange hat is working on something.", False),
        ("A dog runs and a dog jumps, dog and dog.", False),  # never three in a row
        ("A dog dog runs.", False),  # twice is not a loop
        ("Two men on a tononon.", False),  # "on" three times
        ("A sign reads 000 and Mississippi.", False),
        ("", False),
    ],
)
def test_looping_flags_repeated_words_and_repeated_short_pieces(text, loops):
    assert looping(text) is loops


def test_looping_refuses_a_list():
    raises(lambda: looping(["A dog dog dog."]), TypeError, "text must be a str, got list")


def test_bleu_gives_cased_lowercased_and_signature():
    refs = ["A man rides a bike.", "Two dogs play in the snow."]
    result = bleu(["a man rides a bike.", "Two dogs play in the snow."], refs)
    assert result.lowercase == pytest.approx(100.0)
    assert result.score < result.lowercase
    assert "tok:13a" in result.signature and "case:mixed" in result.signature
    assert bleu(refs, refs).score == pytest.approx(100.0)


class CharTokenizer:
    """Just enough of ``tokenizers.Tokenizer`` for :func:`translate`: one id per letter a–i."""

    class Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode_batch(self, sentences):
        return [self.Encoding([3 + ord(c) - ord("a") for c in s]) for s in sentences]

    def decode_batch(self, batch, skip_special_tokens=True):
        return ["".join(chr(ord("a") + i - 3) for i in ids if i >= 3) for ids in batch]


def test_translate_keeps_order_and_restores_mode():
    model = tiny_model().train()
    sentences = ["abcdef", "ab", "ghi"]
    out = translate_sentences(model, CharTokenizer(), sentences, max_len=6)
    assert model.training
    src = torch.tensor([[3 + ord(c) - ord("a") for c in "ab"]])
    direct = greedy_decode(model.eval(), src, max_len=6, **IDS)[0].tolist()
    assert out[1] == CharTokenizer().decode_batch([strip_eos(direct)])[0]
    beam = translate_sentences(model, CharTokenizer(), sentences, beam_size=3, max_len=6)
    assert len(beam) == 3


def never_ending_model(max_len: int) -> Transformer:
    """A model that only ever writes letters: <pad>, <bos> and <eos> are ruled out."""
    model = tiny_model(max_len=max_len)
    with torch.no_grad():
        model.generator.bias[[PAD, BOS, EOS]] = -1e4
    return model


@pytest.mark.parametrize("beam_size", [1, 2])
def test_translate_allows_extra_decode_tokens_beyond_the_source_by_default(beam_size):
    """A sentence that never ends is cut at the default budget: the longest source in the batch
    plus EXTRA_DECODE_TOKENS, within the model's max_len."""
    roomy = never_ending_model(max_len=128)
    out = translate_sentences(roomy, CharTokenizer(), ["abc", "abcde"], beam_size=beam_size)
    assert [len(x) for x in out] == [5 + EXTRA_DECODE_TOKENS] * 2
    cramped = never_ending_model(max_len=20)
    (out,) = translate_sentences(cramped, CharTokenizer(), ["abcdefghi"], beam_size=beam_size)
    assert len(out) == 20


# --- bad inputs: the decoders, translate_sentences, bleu ----------------------------------------

BAD_SRC = torch.tensor([[3, 4, 5, PAD], [6, 7, 8, 9]])
DECODE_ROWS = [
    (
        "beam 0",
        lambda m: beam_search(m, BAD_SRC, beam_size=0, max_len=5, **IDS),
        ValueError,
        "beam_size must be at least 1, got 0",
    ),
    (
        "beam -2",
        lambda m: beam_search(m, BAD_SRC, beam_size=-2, max_len=5, **IDS),
        ValueError,
        "beam_size must be at least 1, got -2",
    ),
    (
        "beam 2.5",
        lambda m: beam_search(m, BAD_SRC, beam_size=2.5, max_len=5, **IDS),
        TypeError,
        "beam_size must be an int",
    ),
    (
        "beam max_len 0",
        lambda m: beam_search(m, BAD_SRC, beam_size=2, max_len=0, **IDS),
        ValueError,
        "max_len must be at least 1, got 0",
    ),
    (
        "negative alpha",
        lambda m: beam_search(m, BAD_SRC, beam_size=2, max_len=5, alpha=-1.0, **IDS),
        ValueError,
        "alpha must be at least 0.0",
    ),
    (
        "greedy max_len 0",
        lambda m: greedy_decode(m, BAD_SRC, max_len=0, **IDS),
        ValueError,
        "max_len must be at least 1, got 0",
    ),
    (
        "greedy min_len -1",
        lambda m: greedy_decode(m, BAD_SRC, max_len=3, min_len=-1, **IDS),
        ValueError,
        "min_len must be at least 0",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "phrase"), [r[1:] for r in DECODE_ROWS], ids=[r[0] for r in DECODE_ROWS]
)
def test_decoders_refuse_bad_arguments(call, error, phrase):
    raises(lambda: call(tiny_model(vocab_size=13)), error, phrase)


TRANSLATE_ROWS = [
    ("a str", "Ein Satz", {}, TypeError, "sentences must be a list of sentences, got one str"),
    ("not a list", 42, {}, TypeError, "sentences must be a list of str, got int"),
    ("a non-str item", ["Ein Satz", 3], {}, TypeError, "sentences[1] must be a str, got int"),
    ("beam 0", ["Ein Satz"], {"beam_size": 0}, ValueError, "beam_size must be at least 1"),
    (
        "max_len 0",
        ["Ein Satz"],
        {"max_len": 0},
        ValueError,
        "max_len=0 must be between 1 and the model's max_len=24",
    ),
    ("max_tokens 0", ["Ein Satz"], {"max_tokens": 0}, ValueError, "max_tokens must be at least 1"),
    ("empty", ["Ein Satz", ""], {}, ValueError, "sentence 2 is empty"),
    ("too long", [" ".join(["Hund"] * 40)], {}, ValueError, "more than the model's max_len=24"),
]


@pytest.mark.parametrize(
    ("sentences", "kwargs", "error", "phrase"),
    [r[1:] for r in TRANSLATE_ROWS],
    ids=[r[0] for r in TRANSLATE_ROWS],
)
def test_translate_sentences_refuses_bad_arguments(
    tiny_checkpoint, sentences, kwargs, error, phrase
):
    model, tokenizer, _ = load_model(tiny_checkpoint)
    raises(lambda: translate_sentences(model, tokenizer, sentences, **kwargs), error, phrase)


BLEU_ROWS = [
    ([], [], ValueError, "bleu needs at least one hypothesis"),
    (["a b"], ["a b", "c"], ValueError, "1 hypotheses but 2 references"),
    ("a b", ["a b"], TypeError, "hyps must be a list of sentences, got one str"),
    (["a b"], [None], TypeError, "refs[0] must be a str"),
]


@pytest.mark.parametrize(("hyps", "refs", "error", "phrase"), BLEU_ROWS, ids=str)
def test_bleu_refuses_bad_arguments(hyps, refs, error, phrase):
    raises(lambda: bleu(hyps, refs), error, phrase)
