"""Chapter 11: decoding — greedy search, beam search, translating text, and BLEU (and chapter
10's test for translations that loop).

Every decoding function is pure: batched, under ``torch.no_grad()``, and keeps no state on the
model. Call ``model.eval()`` first (or use :func:`translate_sentences`, which does it for you).
Each reads back from the device only what it must: the source ids' range once (in
``model.encode``), whether every sentence has finished once a step, and the tokens at the end.

Shapes: source ids ``(B, S)`` → generated ids ``(B, L)`` with ``L ≤ max_len``; each row ends at
its first ``<eos>`` and is padded after it. The leading ``<bos>`` is not returned.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import sacrebleu
import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from transformer_tutorial.checks import check_int, check_number, check_texts
from transformer_tutorial.data import (
    BATCH_TOKENS,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    pad_batch,
    token_batches,
)
from transformer_tutorial.masks import padding_mask
from transformer_tutorial.model import DecoderCache

# GNMT's length-penalty exponent (Wu et al., 2016), the usual choice for beam search.
BEAM_ALPHA = 0.6
# By default a translation may be this many tokens longer than its source.
EXTRA_DECODE_TOKENS = 50
# A piece of one to four letters four times in a row: "ligigigig", "ooooo".
REPEATED_PIECE = re.compile(r"(\w{1,4})\1{3}", re.IGNORECASE)


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    src: Tensor,
    *,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    use_cache: bool = True,
    min_len: int = 0,
) -> Tensor:
    """Pick the most likely next token, one step at a time, for the whole batch at once.

    With ``use_cache`` each step feeds only the newest token through :meth:`decode_step` and
    reuses the keys and values of earlier positions; without it each step runs :meth:`decode`
    over the whole prefix again. Both give the same tokens (unless two logits tie to within
    rounding, where different kernels may break the tie differently). ``<eos>`` cannot be
    chosen before ``min_len`` tokens; ``min_len=max_len`` generates exactly ``max_len`` tokens
    (for timing).

    Shapes:
        src ``(B, S)`` → ``(B, L)``, ``L ≤ max_len``.
    """
    check_int("max_len", max_len, at_least=1)
    check_int("min_len", min_len, at_least=0)
    src_key_padding_mask = padding_mask(src, pad_id)
    memory = model.encode(src, src_key_padding_mask)  # (B, S, D)
    ys = torch.full((src.size(0), 1), bos_id, dtype=torch.long, device=src.device)  # (B, 1)
    finished = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    cache = model.init_cache(memory, src_key_padding_mask) if use_cache else None
    for t in range(max_len):
        if use_cache:
            logits, cache = model.decode_step(ys[:, -1:], cache)  # (B, 1, V)
        else:
            # Nothing in a prefix is padding (finished rows are ignored), as in the cached path.
            logits = model.decode(  # (B, t + 1, V)
                ys,
                memory,
                memory_key_padding_mask=src_key_padding_mask,
                tgt_key_padding_mask=torch.zeros_like(ys, dtype=torch.bool),
                check_ids=False,  # the model's own choices
            )
        scores = logits[:, -1]  # (B, V)
        if t < min_len:  # too early to stop: <eos> is ruled out
            scores = scores.clone()
            scores[:, eos_id] = float("-inf")
        next_token = scores.argmax(dim=-1).masked_fill(finished, pad_id)  # (B,)
        ys = torch.cat([ys, next_token[:, None]], dim=1)
        finished |= next_token == eos_id
        if finished.all():
            break
    return ys[:, 1:]


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's length normalisation ``((5 + length) / 6) ** alpha`` (Wu et al., 2016)."""
    return ((5 + length) / 6) ** alpha


@dataclass(frozen=True)
class Finished:
    """Beam search's best ``K`` finished hypotheses of each sentence, best first."""

    scores: Tensor  # (B, K) log p / length penalty; -inf where there is none yet
    tokens: Tensor  # (B, K, max_len) padded
    lengths: Tensor  # (B, K)

    def merge(self, scores: Tensor, tokens: Tensor, pad_id: int) -> Finished:
        """Keep the best ``K`` of these and new hypotheses: ``scores`` ``(B, N)`` (-inf: not
        finished), ``tokens`` ``(B, N, length)``, padded here to ``max_len``."""
        K, max_len, length = self.scores.size(1), self.tokens.size(2), tokens.size(2)
        best, keep = torch.cat([self.scores, scores], dim=1).topk(K, dim=-1)  # (B, K)
        tokens = nn.functional.pad(tokens, (0, max_len - length), value=pad_id)
        tokens = torch.cat([self.tokens, tokens], dim=1)
        lengths = torch.cat([self.lengths, torch.full_like(scores, length, dtype=torch.long)], 1)
        return Finished(
            best,
            tokens.gather(1, keep[:, :, None].expand(-1, -1, max_len)),
            lengths.gather(1, keep),
        )

    def best(self) -> tuple[Tensor, Tensor]:
        """The best hypothesis of each sentence ``(B, L)``, ``L`` the longest of them, and its
        score ``(B,)``."""
        width = int(self.lengths[:, 0].max())
        return self.tokens[:, 0, :width], self.scores[:, 0]


def _start_beams(
    model: nn.Module, src: Tensor, K: int, max_len: int, bos_id: int, pad_id: int
) -> tuple[DecoderCache, Tensor, Tensor, Finished]:
    """Beam search's start: the memory's cache repeated for ``K`` beams a sentence, every beam
    at ``<bos>``, one live beam a sentence (log p 0), nothing finished."""
    B, device = src.size(0), src.device
    src_key_padding_mask = padding_mask(src, pad_id)
    memory = model.encode(src, src_key_padding_mask)  # (B, S, D)
    rows = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,) the sentence of each beam
    cache = model.init_cache(
        memory.index_select(0, rows), src_key_padding_mask.index_select(0, rows)
    )
    tokens = torch.full((B * K, 1), bos_id, dtype=torch.long, device=device)  # (B*K, t+1)
    alive = torch.full((B, K), float("-inf"), device=device)
    alive[:, 0] = 0.0  # log p of each live beam; at first there is one beam, not K copies of it
    finished = Finished(
        torch.full((B, K), float("-inf"), device=device),
        torch.full((B, K, max_len), pad_id, dtype=torch.long, device=device),
        torch.zeros(B, K, dtype=torch.long, device=device),
    )
    return cache, tokens, alive, finished


def _extend(tokens: Tensor, rows: Tensor, new: Tensor) -> Tensor:
    """The prefixes ``tokens[rows]`` ``(N, t)``, each followed by its token in ``new`` ``(N,)``:
    ``(N, t+1)``."""
    return torch.cat([tokens.index_select(0, rows), new[:, None]], dim=1)


def _drop_decided(
    alive: Tensor, finished: Finished, length: int, max_len: int, alpha: float
) -> Tensor:
    """``alive`` ``(B, K)`` without the beams of the sentences that are decided (-inf): those
    with ``K`` finished hypotheses, and those whose best finished one no live beam can still
    beat. Log p only falls as a beam grows, so a live beam can score at most its log p now over
    the largest length penalty ahead."""
    reach = max(length_penalty(length + 1, alpha), length_penalty(max_len, alpha))
    done = finished.scores[:, -1].isfinite() | (finished.scores[:, 0] >= alive[:, 0] / reach)
    return alive.masked_fill(done[:, None], float("-inf"))


@torch.no_grad()
def beam_search(
    model: nn.Module,
    src: Tensor,
    *,
    beam_size: int,
    max_len: int,
    alpha: float = BEAM_ALPHA,
    bos_id: int,
    eos_id: int,
    pad_id: int,
) -> tuple[Tensor, Tensor]:
    """Keep the ``beam_size`` most likely prefixes of each sentence, for all sentences at once.

    Each step extends every live beam by every token and keeps the best ``2 * beam_size``
    candidates: those ending in ``<eos>`` among the best ``beam_size`` are finished and scored
    ``log p(y) / length_penalty(len(y), alpha)``; the best ``beam_size`` others live on. A
    finished hypothesis is never extended. At ``max_len`` every live beam is finished as it is.
    A sentence stops when it holds ``beam_size`` finished hypotheses, or when no live beam could
    still beat its best one.

    Returns:
        The best finished hypothesis of each sentence ``(B, L)`` and its score ``(B,)``.
    """
    check_int("beam_size", beam_size, at_least=1)
    check_int("max_len", max_len, at_least=1)
    check_number("alpha", alpha, low=0.0)
    B, K, device = src.size(0), beam_size, src.device
    cache, tokens, alive, finished = _start_beams(model, src, K, max_len, bos_id, pad_id)
    first_row = torch.arange(B, device=device)[:, None] * K  # (B, 1)
    for t in range(max_len):
        length, last = t + 1, t + 1 == max_len
        logits, cache = model.decode_step(tokens[:, -1:], cache)  # (B*K, 1, V)
        logp = logits[:, -1].float().log_softmax(dim=-1)  # (B*K, V)
        V = logp.size(-1)
        candidates = (alive[:, :, None] + logp.view(B, K, V)).view(B, K * V)
        top, index = candidates.topk(min(2 * K, K * V), dim=-1)  # (B, N), best first
        beam, token = index // V, index % V  # (B, N)
        source_rows = first_row + beam  # (B, N) rows of ``tokens`` the candidates extend
        ends = (token == eos_id) | last

        # 1) finish: ends among the best K candidates
        rank = torch.arange(top.size(1), device=device)
        finishing = ends & (rank < K) & top.isfinite()
        new_scores = torch.where(finishing, top / length_penalty(length, alpha), float("-inf"))
        new_tokens = _extend(tokens, source_rows.view(-1), token.view(-1))[:, 1:]  # no <bos>
        finished = finished.merge(new_scores, new_tokens.view(B, -1, length), pad_id)

        # 2) live on: the best K candidates that did not end
        alive, pick = torch.where(ends, float("-inf"), top).topk(K, dim=-1)  # (B, K)
        chosen = source_rows.gather(1, pick).view(-1)  # (B*K,)
        tokens = _extend(tokens, chosen, token.gather(1, pick).view(-1))  # (B*K, t+2)
        cache = cache.reorder(chosen)

        # 3) stop a sentence once it is decided, and the batch once all are
        alive = _drop_decided(alive, finished, length, max_len, alpha)
        if not alive.isfinite().any():
            break
    return finished.best()


def strip_eos(ids: Sequence[int], eos_id: int = EOS_ID) -> list[int]:
    """The ids before the first ``eos_id``."""
    ids = list(ids)
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


def translate_sentences(
    model: nn.Module,
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    *,
    beam_size: int = 1,
    max_len: int | None = None,
    alpha: float = BEAM_ALPHA,
    max_tokens: int = BATCH_TOKENS,
) -> list[str]:
    """Translate plain sentences into plain detokenised text, in the order given.

    Sentences are batched by length (about ``max_tokens`` source tokens a batch, divided among
    the beams). ``max_len`` bounds the generated tokens: by default
    :data:`EXTRA_DECODE_TOKENS` more than the longest
    source in the batch, within the model's ``max_len``. Greedy search for ``beam_size=1``.
    """
    check_texts("sentences", sentences)
    check_int("beam_size", beam_size, at_least=1)
    check_int("max_tokens", max_tokens, at_least=1)
    limit = model.config.max_len
    if max_len is not None and not 1 <= max_len <= limit:
        raise ValueError(f"max_len={max_len} must be between 1 and the model's max_len={limit}")
    ids = [e.ids for e in tokenizer.encode_batch(list(sentences))]
    for i, x in enumerate(ids):
        if not x:
            raise ValueError(f"sentence {i + 1} is empty")
        if len(x) > limit:
            raise ValueError(
                f"sentence {i + 1} has {len(x)} tokens, more than the model's max_len={limit}"
            )
    device = next(model.parameters()).device
    out: list[list[int]] = [[] for _ in ids]
    was_training = model.training
    model.eval()
    try:
        for batch in token_batches([len(x) for x in ids], max(max_tokens // beam_size, 1)):
            src = pad_batch([ids[i] for i in batch]).to(device)  # (B, S)
            steps = max_len or min(limit, src.size(1) + EXTRA_DECODE_TOKENS)
            if beam_size == 1:
                hyps = greedy_decode(
                    model, src, max_len=steps, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID
                )
            else:
                hyps, _ = beam_search(
                    model,
                    src,
                    beam_size=beam_size,
                    max_len=steps,
                    alpha=alpha,
                    bos_id=BOS_ID,
                    eos_id=EOS_ID,
                    pad_id=PAD_ID,
                )
            for i, hyp in zip(batch, hyps.tolist(), strict=True):  # one read for the batch
                out[i] = strip_eos(hyp)
    finally:
        model.train(was_training)
    return tokenizer.decode_batch(out, skip_special_tokens=True)


def looping(text: str) -> bool:
    """Whether ``text`` loops the way an undertrained decoder does: one word three times in a
    row (``"a dog dog dog"``, in any case), or a piece of one to four letters four times in a
    row (``"ligigigig"``, ``"ooooo"``). No English sentence of Multi30k does either."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    words = re.findall(r"\w+", text.lower())
    return (
        any(a == b == c for a, b, c in zip(words, words[1:], words[2:], strict=False))
        or REPEATED_PIECE.search(text) is not None
    )


@dataclass(frozen=True)
class BleuScore:
    """sacreBLEU's default corpus BLEU (cased, 13a tokenisation), its signature, and the
    same score lowercased."""

    score: float
    lowercase: float
    signature: str

    def __str__(self) -> str:
        return f"BLEU {self.score:.2f} (lowercased {self.lowercase:.2f}) {self.signature}"


def bleu(hyps: Sequence[str], refs: Sequence[str]) -> BleuScore:
    """Corpus BLEU of detokenised hypotheses against raw references (one reference each)."""
    check_texts("hyps", hyps)
    check_texts("refs", refs)
    if not hyps:
        raise ValueError("bleu needs at least one hypothesis and its reference, got none")
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    cased = sacrebleu.BLEU()
    lower = sacrebleu.BLEU(lowercase=True)
    score = cased.corpus_score(list(hyps), [list(refs)]).score
    return BleuScore(
        score, lower.corpus_score(list(hyps), [list(refs)]).score, str(cased.get_signature())
    )
