"""Chapter 13: choosing the next token — greedy, temperature, top-k, top-p — and generating.

Each filter takes logits ``(B, V)`` and returns logits of the same shape with the tokens it
rules out set to ``-inf``, so that they compose (temperature, then top-k, then top-p, the order
``transformers`` applies them in) and softmax gives them probability 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transformer_tutorial.checks import (
    check_bool,
    check_int,
    check_number,
    check_optional_int,
    check_tensor,
    check_type,
)
from transformer_tutorial.lm.cache import LMCache
from transformer_tutorial.lm.model import LanguageModel


def _check_logits(logits: Tensor) -> None:
    """Float logits ``(..., V)``, ``V >= 1``: integer scores would be rounded and a filter's
    ``-inf`` cannot be stored in them."""
    check_tensor("logits", logits, kind="float")
    if logits.dim() == 0 or logits.size(-1) == 0:
        raise ValueError(f"logits must be (..., V) with V >= 1 tokens, got {tuple(logits.shape)}")


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature``: below 1 sharpens the distribution towards the most likely
    token (greedy in the limit), above 1 flattens it towards uniform."""
    _check_logits(logits)
    check_number("temperature", temperature, low=0.0, low_open=True)
    return logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row (and any tied with the k-th), ``-inf`` the rest.

    Shapes:
        ``(..., V)`` → ``(..., V)``.
    """
    _check_logits(logits)
    check_int("top_k", k, at_least=1)
    k = min(k, logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1) the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability
    reaches ``p``, ``-inf`` the rest; ``p = 1`` keeps every token.

    Sorted by probability, a token is kept when the tokens before it hold less than ``p``: the
    first token is always kept, and the set stops at the token that makes the sum reach ``p``.
    Among tokens of equal probability the lower id comes first.

    The mass before a token is summed in float64 (float32 where the device has none): a float32
    running sum over 50,000 probabilities drifts by about 1e-4 and reaches ``p`` early, which
    drops tokens the set needs (at ``p = 1`` thousands of them).

    Shapes:
        ``(..., V)`` → ``(..., V)``.
    """
    _check_logits(logits)
    check_number("top_p", p, low=0.0, high=1.0, low_open=True)
    if p == 1.0:
        return logits
    wide = torch.float32 if logits.device.type == "mps" else torch.float64
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits.to(wide), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # (..., V) the mass of the tokens ranked above
    drop_sorted = before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Temperature > 0, top-k None or >= 1, top-p None or in (0, 1]; else a clear error."""
    check_number("temperature", temperature, low=0.0, low_open=True)
    check_optional_int("top_k", top_k, at_least=1)
    if top_p is not None:
        check_number("top_p", top_p, low=0.0, high=1.0, low_open=True)


def filter_logits(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """Temperature, then top-k (if given), then top-p (if given): the logits to sample from."""
    check_sampling(temperature, top_k, top_p)
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return logits


def sample(log_probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token from each distribution of ``log_probs`` ``(..., V)`` (``-inf`` where a token
    is ruled out) → ``(...)``, by the Gumbel-max trick: ``argmax(log p + G)`` with
    ``G = -log(-log U)`` is a sample from ``p``. ``U`` is drawn by ``torch.rand`` in the
    log-probabilities' dtype, whose stream a seed fixes on every torch release (that of
    ``torch.multinomial`` changed between 2.6 and 2.13): a seeded sample is the same anywhere.
    """
    check_tensor("log_probs", log_probs, kind="float", shape="(..., V)")
    if log_probs.dim() == 0 or log_probs.size(-1) == 0:
        raise ValueError(f"log_probs must be (..., V) with V >= 1, got {tuple(log_probs.shape)}")
    if generator is not None:
        check_type("generator", generator, torch.Generator, "a torch.Generator or None")
    u = torch.rand(
        log_probs.shape, generator=generator, dtype=log_probs.dtype, device=log_probs.device
    )
    gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))
    return (log_probs + gumbel).argmax(dim=-1)


def next_token(
    logits: Tensor,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row of ``logits`` ``(B, V)`` → ``(B,)``: the most likely one when
    ``greedy``, else a sample from the filtered distribution (reproducible with a seeded
    ``generator`` on the logits' device)."""
    check_tensor("logits", logits, kind="float", dims=2, shape="(B, V)")
    _check_logits(logits)
    check_bool("greedy", greedy)
    check_sampling(temperature, top_k, top_p)
    if generator is not None:
        check_type("generator", generator, torch.Generator, "a torch.Generator or None")
    if greedy:
        return logits.argmax(dim=-1)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return sample(torch.log_softmax(filtered.float(), dim=-1), generator)  # -inf: filtered out


def check_prompt(model: LanguageModel, prompt: Tensor, max_new_tokens: int) -> None:
    """Refuse a prompt that is not ``(B, T0)`` ids with ``B, T0 >= 1``, or that would grow past
    the model's ``max_len`` with ``max_new_tokens`` more."""
    check_type("model", model, LanguageModel, "a LanguageModel")
    check_tensor("prompt", prompt, kind="int")
    check_int("max_new_tokens", max_new_tokens, at_least=0)
    if prompt.dim() != 2 or prompt.size(0) < 1 or prompt.size(1) < 1:
        raise ValueError(
            f"prompt must be (B, T0) ids with B >= 1 and T0 >= 1, got {tuple(prompt.shape)}"
        )
    total = prompt.size(1) + max_new_tokens
    if total > model.config.max_len:
        raise ValueError(
            f"prompt length {prompt.size(1)} + max_new_tokens {max_new_tokens} = {total} "
            f"exceeds the model's max_len={model.config.max_len}"
        )


def check_stop_ids(model: LanguageModel, *, eos_id: int | None, pad_id: int | None = None) -> None:
    """``eos_id`` and ``pad_id``: None or a token of the model's vocabulary (an ``eos_id``
    outside it could never stop a row; a ``pad_id`` outside it is fed to the model once a row
    has finished)."""
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        check_optional_int(name, value, at_least=0)
        if value is not None and value >= model.config.vocab_size:
            raise ValueError(
                f"{name}={value} is no token of the model's vocabulary (0 to "
                f"{model.config.vocab_size - 1})"
            )


def check_cache_choice(cache: LMCache | None, cache_kind: str | None, use_cache: bool) -> None:
    """At most one of ``cache`` (empty, ready made) and ``cache_kind`` (one to make), and
    neither without ``use_cache``. The kind itself is the model's to check
    (:meth:`LanguageModel.new_cache`)."""
    check_bool("use_cache", use_cache)
    if cache is not None and cache_kind is not None:
        raise ValueError(
            f"pass cache or cache_kind, not both: cache_kind={cache_kind!r} names the kind of "
            f"cache to make, cache is one already made"
        )
    for name, value in (("cache", cache), ("cache_kind", cache_kind)):
        if value is not None and not use_cache:
            raise ValueError(f"{name} needs use_cache=True; without, nothing is cached")
    if cache is not None:
        what = "an empty LMCache (model.new_cache) or None"
        check_type("cache", cache, LMCache, what)
        if cache.length:
            raise ValueError(
                f"cache must be empty, got one holding {cache.length} positions: the prompt "
                f"starts at position 0 (make a new cache for each call)"
            )


def _new_cache(
    model: LanguageModel, batch_size: int, cache_kind: str | None, max_len: int
) -> LMCache:
    """``model.new_cache`` of ``cache_kind`` (None: ``"growing"``), whose check of the kind is
    the one: its error, naming the argument of :func:`generate` it came from."""
    try:
        return model.new_cache(
            batch_size, "growing" if cache_kind is None else cache_kind, max_len=max_len
        )
    except ValueError as error:
        raise ValueError(f"cache_kind: {error}") from error


@torch.no_grad()
def generate(
    model: LanguageModel,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    cache_kind: str | None = None,
    cache: LMCache | None = None,
) -> Tensor:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    A row that produces ``eos_id`` is finished: later positions get ``pad_id`` (``eos_id`` when
    None), and the loop stops once every row is finished. With ``use_cache`` each step feeds
    only the new token and the layers' keys and values are kept (:meth:`LanguageModel.step`);
    without, each step recomputes the whole sequence. The two give the same tokens.
    ``cache_kind``: the kind of cache to make (:meth:`LanguageModel.new_cache`), ``"growing"``
    (None) or ``"preallocated"`` (for the prompt and every new token); or ``cache``: an empty
    cache already made (``model.new_cache``, of any kind), which the call fills.

    Reads back from the device: the prompt's id range once, then one read a token with
    ``eos_id`` ("has every row finished?") and none without (without ``use_cache`` each
    forward pass also checks the ids again: one more a token; a mixture-of-experts layer reads
    its tokens per expert, chapter 20: one more a layer and token).

    Args:
        model: a :class:`LanguageModel`, put in ``eval()`` by the caller.
        prompt: ``(B, T0)`` ids, ``T0 >= 1``, no padding (e.g. ``<bos>`` alone).
        greedy, temperature, top_k, top_p, generator: as :func:`next_token`.

    Returns:
        ``(B, T0 + n)`` ids, prompt included, ``n <= max_new_tokens``.
    """
    check_prompt(model, prompt, max_new_tokens)
    check_stop_ids(model, eos_id=eos_id, pad_id=pad_id)
    check_sampling(temperature, top_k, top_p)
    check_cache_choice(cache, cache_kind, use_cache)
    total = prompt.size(1) + max_new_tokens
    fill = eos_id if pad_id is None else pad_id
    ids = prompt
    finished = torch.zeros(prompt.size(0), dtype=torch.bool, device=prompt.device)
    if use_cache:
        if cache is None:
            cache = _new_cache(model, prompt.size(0), cache_kind, total)
        logits, cache = model.step(prompt, cache)
    else:
        logits = model(prompt)
    for _ in range(max_new_tokens):
        token = next_token(
            logits[:, -1],
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
        )  # (B,)
        if eos_id is not None:
            token = token.masked_fill(finished, fill)
            finished = finished | (token == eos_id)
        ids = torch.cat([ids, token[:, None]], dim=1)
        if ids.size(1) == total or (eos_id is not None and finished.all()):  # a read
            break
        if use_cache:  # the model's own tokens: no range check (no read)
            logits, cache = model.step(token[:, None], cache, check_ids=False)
        else:
            logits = model(ids)
    return ids
