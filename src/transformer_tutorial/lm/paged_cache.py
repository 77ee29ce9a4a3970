"""Chapter 23: a cache that does not grow — paged — and continuous batching.

Chapter 17's cache grows by concatenation, copying every held key at every step; chapter 16's
preallocated cache (``model.new_cache(B, "preallocated")``) allocates each layer's buffers once
for the longest sequence. A paged cache (vLLM's PagedAttention, Kwon et al. 2023) cuts one pool
of memory per layer into blocks of ``block_size`` positions and gives each sequence a *block
table*, the blocks it holds in order: a sequence takes blocks as it grows and gives them back
when it ends, so sequences of any length share one pool. It registers itself as the cache kind
``"paged"``: ``model.new_cache(B, "paged", n_blocks=..., block_size=...)``, over whatever
layout each layer's attention declares (chapter 16's keys and values, chapter 21's latents).
:class:`Scheduler` and :func:`continuous_greedy` use it: requests join the batch as others
leave it.

Shapes: a layer's pool, one per tensor of its layout, ``(n_blocks, block_size, *per position)``
(keys: ``(n_blocks, block_size, Hkv, Dh)``; latents: ``(n_blocks, block_size, Dc + Dr)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from transformer_tutorial.checks import check_int, check_optional_int, check_type
from transformer_tutorial.lm.cache import CacheLayout, LMCache, check_new_positions
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.registry import CACHE_KINDS, Piece


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

    def reserve_rows(self, seqs: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
        """:meth:`reserve` for every sequence of ``seqs`` at once, all or nothing: an error, with
        nothing taken, when the free blocks do not cover them all."""
        needed = sum(
            max(0, -(-length // self.block_size) - len(self.tables.get(seq, [])))
            for seq, length in zip(seqs, lengths, strict=True)
        )
        if needed > len(self.free):
            raise RuntimeError(
                f"all {self.n_blocks} blocks of {self.block_size} positions are in use: "
                f"build the cache with more n_blocks"
            )
        return [self.reserve(seq, length) for seq, length in zip(seqs, lengths, strict=True)]

    def release(self, seq: int) -> None:
        """Give the blocks of ``seq`` back to the pool."""
        self.free.extend(reversed(self.tables.pop(seq, [])))


class PagedCache:
    """One layer's cache in blocks of a shared pool, for the sequences ``seqs`` (the rows of the
    batch, in order), each ``lengths[i]`` positions long; one pool per tensor of the ``layout``
    its attention declares.

    Called like a growing cache: :meth:`update` writes the new positions into each row's blocks
    and returns every held position's tensors, gathered through the block tables into the
    layout's shapes with ``S`` the longest row; a shorter row's positions past its length are
    filler, which the caller masks as padding (:func:`continuous_greedy`).
    """

    def __init__(
        self,
        layout: CacheLayout,
        pools: Sequence[Tensor],
        allocator: BlockAllocator,
        seqs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        if len(seqs) != len(lengths):
            raise ValueError(f"seqs ({len(seqs)}) and lengths ({len(lengths)}) must pair up")
        self.layout, self.pools, self.allocator = layout, tuple(pools), allocator
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
        """Bytes of this layer's pools (shared by every sequence)."""
        return sum(pool.untyped_storage().nbytes() for pool in self.pools)

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` positions of every row (their blocks stay reserved)."""
        check_int("n", n, at_least=0)
        if n > min(self.lengths):
            raise ValueError(f"n={n} exceeds the {min(self.lengths)} positions a row holds")
        self.lengths = tuple(length - n for length in self.lengths)

    def update(self, *new: Tensor, keep: int | None = None) -> tuple[Tensor, ...]:
        """Write the new positions (``L`` of them, along the layout's ``seq_dim``) after each
        row's; return the rows' held positions, ``S`` along ``seq_dim``."""
        if keep is not None:
            raise ValueError("the paged cache keeps every position: it takes no sliding window")
        check_new_positions(self.layout, new)
        d = self.layout.seq_dim
        B, L = new[0].size(0), new[0].size(d)
        if len(self.seqs) != B:
            raise ValueError(f"{self.layout.names[0]} has {B} rows; the cache {len(self.seqs)}")
        if L > 1 and len(set(self.lengths)) > 1:
            raise ValueError(
                f"rows of lengths {self.lengths} take one new position at a time; fill a "
                f"row's prompt on its own"
            )
        bs = self.allocator.block_size
        tables = self.allocator.reserve_rows(self.seqs, [n + L for n in self.lengths])
        # 1) write: position p of a row goes to slot p % bs of its block p // bs
        slots = [
            t[p // bs] * bs + p % bs
            for t, n in zip(tables, self.lengths, strict=True)
            for p in range(n, n + L)
        ]
        index = torch.tensor(slots, device=new[0].device)  # (B·L,)
        for pool, x in zip(self.pools, new, strict=True):  # x: positions moved next to rows
            pool.flatten(0, 1)[index] = x.movedim(d, 1).flatten(0, 1)
        self.lengths = tuple(n + L for n in self.lengths)
        # 2) gather: each row's blocks in table order, the missing ones as block 0 (filler)
        S, width = self.seen, -(-self.seen // bs)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=index.device)
        # (B, width, bs, ...) → (B, S, ...) → the positions back at seq_dim
        return tuple(pool[table].flatten(1, 2)[:, :S].movedim(1, d) for pool in self.pools)


class PagedPiece(Piece):
    """The cache kind ``"paged"``: one pool per layer and tensor, cut into ``n_blocks`` blocks
    of ``block_size`` positions by one :class:`BlockAllocator` that every layer shares; the
    ``batch_size`` sequences are numbered 0 …"""

    def new(
        self,
        layouts: Sequence[CacheLayout],
        batch_size: int,
        *,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        n_blocks: int | None = None,
        block_size: int | None = None,
        allocator: BlockAllocator | None = None,
    ) -> LMCache:
        if n_blocks is None or block_size is None:
            raise ValueError(
                "the paged cache needs n_blocks and block_size: model.new_cache(B, 'paged', "
                "n_blocks=..., block_size=...), then generate(..., cache=...)"
            )
        check_int("n_blocks", n_blocks, at_least=1)
        check_int("block_size", block_size, at_least=1)
        if allocator is None:
            allocator = BlockAllocator(n_blocks, block_size)
        check_type("allocator", allocator, BlockAllocator, "a BlockAllocator or None")
        if (allocator.n_blocks, allocator.block_size) != (n_blocks, block_size):
            raise ValueError(
                f"allocator cuts {allocator.n_blocks} blocks of {allocator.block_size} "
                f"positions; the pools have n_blocks={n_blocks} of block_size={block_size}"
            )
        layers = []
        for layout in layouts:
            pools = [
                torch.zeros((n_blocks, block_size, *shape), dtype=dtype, device=device)
                for shape in layout.shapes
            ]
            layers.append(
                PagedCache(layout, pools, allocator, range(batch_size), [0] * batch_size)
            )
        return LMCache(layers)


CACHE_KINDS.register("paged", PagedPiece())


def _rows(cache: LMCache, seqs: Sequence[int], lengths: Sequence[int]) -> LMCache:
    """The same pools and allocator, for the sequences ``seqs`` of ``lengths``."""
    layers = tuple(PagedCache(c.layout, c.pools, c.allocator, seqs, lengths) for c in cache.layers)
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
        check_type("model", model, LanguageModel, "a LanguageModel")
        if model.rotary is None:
            raise ValueError("continuous batching needs positions='rope' (per-row position ids)")
        check_int("max_batch", max_batch, at_least=1)
        check_optional_int("eos_id", eos_id, at_least=0)
        if eos_id is not None and eos_id >= model.config.vocab_size:
            raise ValueError(
                f"eos_id={eos_id} is outside the vocabulary of {model.config.vocab_size} tokens"
            )
        self.model, self.max_batch, self.eos_id = model, max_batch, eos_id
        self.pools = model.new_cache(1, "paged", n_blocks=n_blocks, block_size=block_size)
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
        return self.pools.layers[0].pools[0].device

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
