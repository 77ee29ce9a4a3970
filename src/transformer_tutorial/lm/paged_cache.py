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

from transformer_tutorial.checks import check_int, check_optional_int, check_type
from transformer_tutorial.lm.cache import LMCache
from transformer_tutorial.lm.model import LanguageModel


def _check_grouped(model: LanguageModel) -> None:
    check_type("model", model, LanguageModel, "a LanguageModel")
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
    check_type("model", model, LanguageModel, "a LanguageModel")
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
        """The block table of ``seq``, grown to cover ``length`` positions; an error, with
        nothing taken, when the free blocks do not cover it."""
        check_int("length", length, at_least=0)
        table = self.tables.get(seq, [])
        needed = -(-length // self.block_size) - len(table)  # blocks still to take
        if needed > len(self.free):
            raise RuntimeError(
                f"all {self.n_blocks} blocks of {self.block_size} positions are in use: "
                f"build the cache with more n_blocks"
            )
        table = self.tables.setdefault(seq, table)
        table.extend(self.free.pop() for _ in range(needed))
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
    if model.config.window is not None:
        raise ValueError("the paged cache keeps every position: it takes no sliding window")
    if allocator is None:
        allocator = BlockAllocator(n_blocks, block_size)
    check_type("allocator", allocator, BlockAllocator, "a BlockAllocator or None")
    if (allocator.n_blocks, allocator.block_size) != (n_blocks, block_size):
        raise ValueError(
            f"allocator cuts {allocator.n_blocks} blocks of {allocator.block_size} positions; "
            f"the pools have n_blocks={n_blocks} of block_size={block_size}"
        )
    weight = model.embed.weight  # the activations' dtype, even where linears are quantized
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


class Scheduler:
    """Continuous batching over one paged pool that never loses work (vLLM's scheduler, less
    swapping and chunked prefill).

    - **Admission**: a waiting request joins, first come first served, when fewer than
      ``max_batch`` rows run and the free blocks cover its prompt and next token *after* the
      running rows' blocks for their next step (a watermark of exactly one step).
    - **Preemption by recomputation**: when the running rows' next step needs more blocks than
      are free, the request that joined last gives its blocks back and returns to the head of
      the queue with the tokens it has; when it joins again its prompt and those tokens are
      filled anew, so it goes on exactly where it stopped.
    - A request longer than the model's ``max_len`` or than the whole pool is refused before any
      decoding.

    :meth:`run` returns each request's new tokens; ``preemptions`` and ``steps`` count the
    preemptions and the batched decoding steps of the last run.
    """

    def __init__(
        self,
        model: LanguageModel,
        *,
        max_batch: int,
        n_blocks: int,
        block_size: int,
        eos_id: int | None = None,
    ) -> None:
        _check_grouped(model)
        if model.config.positions != "rope":
            raise ValueError("continuous batching needs positions='rope' (per-row position ids)")
        check_int("max_batch", max_batch, at_least=1)
        check_optional_int("eos_id", eos_id, at_least=0)
        if eos_id is not None and eos_id >= model.config.vocab_size:
            raise ValueError(
                f"eos_id={eos_id} is outside the vocabulary of {model.config.vocab_size} tokens"
            )
        self.model, self.max_batch, self.eos_id = model, max_batch, eos_id
        self.pools = paged_cache(model, 1, n_blocks=n_blocks, block_size=block_size)
        self.allocator: BlockAllocator = self.pools.layers[0].allocator
        self.preemptions = self.steps = 0

    @torch.no_grad()
    def run(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]
    ) -> list[list[int]]:
        """Greedy continuations of every prompt, ``max_new_tokens[i]`` tokens each (fewer if
        one is ``eos_id``), in the order of ``prompts``."""
        self._check_requests(prompts, max_new_tokens)
        self.prompts, self.budgets = [list(p) for p in prompts], list(max_new_tokens)
        self.out: list[list[int]] = [[] for _ in prompts]
        self.waiting = [r for r in range(len(prompts)) if self.budgets[r] > 0]
        self.running: dict[int, int] = {}  # request → positions it holds (all but its last token)
        self.preemptions = self.steps = 0
        while self.waiting or self.running:
            self._admit()
            self._preempt()
            self._step()
        return self.out

    def _blocks(self, positions: int) -> int:
        return -(-positions // self.allocator.block_size)

    def _growth(self) -> int:
        """Blocks the running rows take in their next step."""
        tables = self.allocator.tables
        return sum(max(0, self._blocks(n + 1) - len(tables[r])) for r, n in self.running.items())

    def _admit(self) -> None:
        """1) join: fill prompts (and tokens already decoded, after a preemption) on their own."""
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            held = len(self.prompts[r]) + len(self.out[r])  # positions its filling writes
            last = len(self.prompts[r]) + self.budgets[r] - 1  # the most it ever holds
            needs = self._blocks(min(held + 1, last)) + self._growth()
            if needs > len(self.allocator.free):
                return
            self.waiting.pop(0)
            ids = torch.tensor([self.prompts[r] + self.out[r]], device=self._device)
            logits, _ = self.model.step(ids, _rows(self.pools, [r], [0]))
            self.out[r].append(int(logits[0, -1].argmax()))
            self.running[r] = held
            self._leave_if_finished(r)

    def _preempt(self) -> None:
        """2) give the blocks of the latest joined request back while the next step lacks them."""
        while self._growth() > len(self.allocator.free):
            r = next(reversed(self.running))  # the one that joined last
            del self.running[r]
            self.allocator.release(r)
            self.waiting.insert(0, r)
            self.preemptions += 1

    def _step(self) -> None:
        """3) one step of every running row together; finished requests leave."""
        if not self.running:
            return
        device = self._device
        seqs, lengths = list(self.running), list(self.running.values())
        S = max(lengths) + 1
        real = torch.arange(S, device=device) < torch.tensor(lengths, device=device)[:, None] + 1
        last = torch.tensor([[self.out[r][-1]] for r in seqs], device=device)  # (B, 1)
        logits, _ = self.model.step(last, _rows(self.pools, seqs, lengths), padding_mask=~real)
        self.steps += 1
        for r, token in zip(seqs, logits[:, -1].argmax(-1).tolist(), strict=True):
            self.out[r].append(token)
            self.running[r] += 1
            self._leave_if_finished(r)

    def _leave_if_finished(self, r: int) -> None:
        tokens = self.out[r]
        if len(tokens) >= self.budgets[r] or tokens[-1] == self.eos_id:
            del self.running[r]
            self.allocator.release(r)

    @property
    def _device(self) -> torch.device:
        return self.pools.layers[0].pool_k.device

    def _check_requests(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]
    ) -> None:
        if len(prompts) != len(max_new_tokens):
            raise ValueError(
                f"prompts ({len(prompts)}) and max_new_tokens ({len(max_new_tokens)}) must pair up"
            )
        V, max_len = self.model.config.vocab_size, self.model.config.max_len
        pool = self.allocator.n_blocks * self.allocator.block_size
        for i, (prompt, budget) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            check_int(f"max_new_tokens[{i}]", budget, at_least=0)
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty: a request needs at least one token")
            if not all(isinstance(t, int) and 0 <= t < V for t in prompt):
                raise ValueError(f"prompts[{i}] holds a token outside 0 … {V - 1}")
            held = len(prompt) + budget - 1  # the last new token is never cached
            if budget and held > max_len:
                raise ValueError(
                    f"request {i} needs {held} positions ({len(prompt)} prompt + {budget} new "
                    f"- 1), more than the model's max_len={max_len}"
                )
            if budget and held > pool:
                raise ValueError(
                    f"request {i} needs {held} positions, more than the whole pool holds "
                    f"({self.allocator.n_blocks} blocks of {self.allocator.block_size})"
                )


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
    batching (:class:`Scheduler`): a request joins as soon as a row and the blocks it needs are
    free (its prompt filled on its own, into its blocks), every running row then takes one step
    together, and a request leaves (its blocks freed) when it has its ``max_new_tokens[i]``
    tokens or produces ``eos_id``. When the pool runs short, the request that joined last is
    preempted and recomputed later: no work is lost.

    Rows of different lengths are one batch: each row's keys end at its own length, the
    positions after it are masked as padding, and the rotary position of a row's new token is
    the number of its real positions (:meth:`LanguageModel.step`'s ``padding_mask``).

    Returns each request's new tokens, in the order of ``prompts``.
    """
    scheduler = Scheduler(
        model, max_batch=max_batch, n_blocks=n_blocks, block_size=block_size, eos_id=eos_id
    )
    return scheduler.run(prompts, max_new_tokens)
