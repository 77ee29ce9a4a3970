"""Chapter 23: caches that do not grow — preallocated and paged — and continuous batching.

Chapter 17's cache grows by concatenation, copying every held key at every step. A
preallocated cache (:func:`preallocated_cache`) allocates each layer's buffers once for the
longest sequence. A paged cache (:func:`paged_cache`, vLLM's PagedAttention, Kwon et al. 2023)
cuts one pool of memory per layer into blocks of ``block_size`` positions and gives each
sequence a *block table*, the blocks it holds in order: a sequence takes blocks as it grows and
gives them back when it ends, so sequences of any length share one pool.
:func:`continuous_greedy` uses that: requests join the batch as others leave it.

Shapes: keys and values ``(B, Hkv, S, Dh)``; a layer's pool ``(n_blocks, block_size, Hkv, Dh)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from transformer_tutorial.checks import check_int
from transformer_tutorial.lm.cache import LMCache
from transformer_tutorial.lm.model import LanguageModel


def _check_grouped(model: LanguageModel) -> None:
    if model.config.attention != "gqa":
        raise ValueError(
            f"these caches hold chapter 16's keys and values: the model needs attention='gqa', "
            f"got {model.config.attention!r}"
        )


def preallocated_cache(
    model: LanguageModel, batch_size: int, max_len: int | None = None
) -> LMCache:
    """An empty :class:`LMCache` whose layers' buffers hold ``max_len`` positions (default the
    model's), allocated now in the model's dtype and device: ``model.new_cache(batch_size,
    "preallocated", max_len=max_len)``."""
    return model.new_cache(batch_size, "preallocated", max_len=max_len)


class BlockAllocator:
    """The blocks of a pool: which are free, and each sequence's block table. One allocator
    serves every layer (each layer has its own pool, cut the same way)."""

    def __init__(self, n_blocks: int, block_size: int) -> None:
        check_int("n_blocks", n_blocks, at_least=1)
        check_int("block_size", block_size, at_least=1)
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.tables: dict[int, list[int]] = {}  # sequence → its blocks, in order

    def reserve(self, seq: int, length: int) -> list[int]:
        """The block table of ``seq``, grown to cover ``length`` positions."""
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < length:
            if not self.free:
                raise RuntimeError(
                    f"all {self.n_blocks} blocks of {self.block_size} positions are in use: "
                    f"build the cache with more n_blocks"
                )
            table.append(self.free.pop())
        return table

    def release(self, seq: int) -> None:
        """Give the blocks of ``seq`` back to the pool."""
        self.free.extend(reversed(self.tables.pop(seq, [])))


class PagedKVCache:
    """One layer's keys and values in blocks of a shared pool, for the sequences ``seqs`` (the
    rows of the batch, in order), each ``lengths[i]`` positions long.

    Called like :class:`~transformer_tutorial.lm.cache.GroupedKVCache`: :meth:`update` writes
    the new positions into each row's blocks and returns every held position's keys and
    values, gathered through the block tables into ``(B, Hkv, S, Dh)`` with ``S`` the longest
    row; a shorter row's positions past its length are filler, which the caller masks as
    padding (:func:`continuous_greedy`).
    """

    holds = "keys and values"

    def __init__(
        self,
        pool_k: Tensor,
        pool_v: Tensor,
        allocator: BlockAllocator,
        seqs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        if len(seqs) != len(lengths):
            raise ValueError(f"seqs ({len(seqs)}) and lengths ({len(lengths)}) must pair up")
        self.pool_k, self.pool_v, self.allocator = pool_k, pool_v, allocator
        self.seqs, self.lengths = tuple(seqs), tuple(lengths)

    @property
    def seen(self) -> int:
        """The longest row's length: the next position of a row that has no padding."""
        return max(self.lengths)

    @property
    def batch_size(self) -> int:
        """The rows: one a sequence."""
        return len(self.seqs)

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's pool (shared by every sequence)."""
        return self.pool_k.untyped_storage().nbytes() + self.pool_v.untyped_storage().nbytes()

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` positions of every row (their blocks stay reserved)."""
        check_int("n", n, at_least=0)
        if n > min(self.lengths):
            raise ValueError(f"n={n} exceeds the {min(self.lengths)} positions a row holds")
        self.lengths = tuple(length - n for length in self.lengths)

    def update(self, k: Tensor, v: Tensor, *, keep: int | None = None) -> tuple[Tensor, Tensor]:
        """Write the new positions ``(B, Hkv, L, Dh)`` after each row's; return the rows' keys
        and values ``(B, Hkv, S, Dh)``."""
        if keep is not None:
            raise ValueError("the paged cache keeps every position: it takes no sliding window")
        B, Hkv, L, Dh = k.shape
        if L > 1 and len(set(self.lengths)) > 1:
            raise ValueError(
                f"rows of lengths {self.lengths} take one new position at a time; fill a "
                f"row's prompt on its own"
            )
        bs = self.allocator.block_size
        tables = [
            self.allocator.reserve(s, n + L) for s, n in zip(self.seqs, self.lengths, strict=True)
        ]
        # 1) write: position p of a row goes to slot p % bs of its block p // bs
        slots = [
            t[p // bs] * bs + p % bs
            for t, n in zip(tables, self.lengths, strict=True)
            for p in range(n, n + L)
        ]
        index = torch.tensor(slots, device=k.device)  # (B·L,)
        self.pool_k.view(-1, Hkv, Dh)[index] = k.transpose(1, 2).reshape(B * L, Hkv, Dh)
        self.pool_v.view(-1, Hkv, Dh)[index] = v.transpose(1, 2).reshape(B * L, Hkv, Dh)
        self.lengths = tuple(n + L for n in self.lengths)
        # 2) gather: each row's blocks in table order, the missing ones as block 0 (filler)
        S, width = self.seen, -(-self.seen // bs)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=k.device)

        def gather(pool: Tensor) -> Tensor:
            blocks = pool[table]  # (B, width, bs, Hkv, Dh)
            return blocks.flatten(1, 2)[:, :S].transpose(1, 2)  # (B, Hkv, S, Dh)

        return gather(self.pool_k), gather(self.pool_v)


def paged_cache(
    model: LanguageModel,
    batch_size: int,
    *,
    n_blocks: int,
    block_size: int,
    allocator: BlockAllocator | None = None,
) -> LMCache:
    """An empty :class:`LMCache` of :class:`PagedKVCache` layers for ``batch_size`` sequences
    (numbered 0 …), each layer's pool ``n_blocks`` blocks of ``block_size`` positions."""
    _check_grouped(model)
    check_int("n_blocks", n_blocks, at_least=1)
    check_int("block_size", block_size, at_least=1)
    check_int("batch_size", batch_size, at_least=1)
    if model.config.max_len % block_size:
        raise ValueError(
            f"block_size={block_size} must divide the model's max_len={model.config.max_len}, "
            f"so that a sequence's blocks end where the model does"
        )
    if model.config.window is not None:
        raise ValueError("the paged cache keeps every position: it takes no sliding window")
    allocator = BlockAllocator(n_blocks, block_size) if allocator is None else allocator
    weight = model.lm_head.weight
    layers = []
    for layer in model.layers:
        shape = (n_blocks, block_size, layer.self_attn.n_kv_heads, layer.self_attn.d_head)
        pool_k = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        pool_v = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        layers.append(PagedKVCache(pool_k, pool_v, allocator, range(batch_size), [0] * batch_size))
    return LMCache(layers)


@torch.no_grad()
def greedy_with_cache(
    model: LanguageModel, prompt: Tensor, max_new_tokens: int, cache: LMCache
) -> Tensor:
    """Greedy decoding of ``prompt`` ``(B, T0)`` by ``max_new_tokens`` tokens, starting from the
    empty ``cache`` of the caller's kind: ``(B, T0 + max_new_tokens)``."""
    check_int("max_new_tokens", max_new_tokens, at_least=0)
    ids, new = prompt, prompt
    for _ in range(max_new_tokens):
        logits, cache = model.step(new, cache)
        new = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        ids = torch.cat([ids, new], dim=1)
    return ids


def _rows(cache: LMCache, seqs: Sequence[int], lengths: Sequence[int]) -> LMCache:
    """The same pools and allocator, for the sequences ``seqs`` of ``lengths``."""
    layers = tuple(
        PagedKVCache(c.pool_k, c.pool_v, c.allocator, seqs, lengths) for c in cache.layers
    )
    return LMCache(layers)


@torch.no_grad()
def continuous_greedy(
    model: LanguageModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    *,
    max_batch: int,
    n_blocks: int,
    block_size: int,
    eos_id: int | None = None,
) -> list[list[int]]:
    """Greedy continuations of every prompt, decoded ``max_batch`` at a time with continuous
    batching: a request joins as soon as a row is free (its prompt filled on its own, into its
    blocks), every running row then takes one step together, and a request leaves (its blocks
    freed) when it has its ``max_new_tokens[i]`` tokens or produces ``eos_id``.

    Rows of different lengths are one batch: each row's keys end at its own length, the
    positions after it are masked as padding, and the rotary position of a row's new token is
    the number of its real positions (:meth:`LanguageModel.step`'s ``padding_mask``).

    Returns each request's new tokens, in the order of ``prompts``.
    """
    _check_grouped(model)
    if model.config.positions != "rope":
        raise ValueError("continuous batching needs positions='rope' (per-row position ids)")
    check_int("max_batch", max_batch, at_least=1)
    if len(prompts) != len(max_new_tokens):
        raise ValueError(
            f"prompts ({len(prompts)}) and max_new_tokens ({len(max_new_tokens)}) must pair up"
        )
    device = model.lm_head.weight.device
    pools = paged_cache(model, 1, n_blocks=n_blocks, block_size=block_size)
    allocator = pools.layers[0].allocator
    waiting = list(range(len(prompts)))
    out: list[list[int]] = [[] for _ in prompts]
    running: dict[int, int] = {}  # request → its length in the cache (all but its last token)
    while waiting or running:
        while waiting and len(running) < max_batch:  # 1) join: fill the prompt on its own
            r = waiting.pop(0)
            if max_new_tokens[r] == 0:
                continue
            ids = torch.tensor([list(prompts[r])], device=device)
            logits, _ = model.step(ids, _rows(pools, [r], [0]))
            out[r].append(int(logits[0, -1].argmax()))
            running[r] = ids.size(1)
        done = [r for r in running if _finished(out[r], max_new_tokens[r], eos_id)]
        for r in done:  # 2) leave: give the blocks back
            del running[r]
            allocator.release(r)
        if not running or (len(running) < max_batch and waiting):
            continue
        seqs, lengths = list(running), [running[r] for r in running]
        S = max(lengths) + 1
        real = torch.arange(S, device=device) < torch.tensor(lengths, device=device)[:, None] + 1
        last = torch.tensor([[out[r][-1]] for r in seqs], device=device)  # (B, 1)
        logits, _ = model.step(last, _rows(pools, seqs, lengths), padding_mask=~real)
        for r, token in zip(seqs, logits[:, -1].argmax(-1).tolist(), strict=True):  # 3) a step
            out[r].append(token)
            running[r] += 1
    return out


def _finished(tokens: list[int], budget: int, eos_id: int | None) -> bool:
    return len(tokens) >= budget or (eos_id is not None and tokens[-1] == eos_id)
