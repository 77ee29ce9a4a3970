"""Chapter 26: supervised fine-tuning — the loss on the answer's tokens only, and packing.

:func:`sft_labels` keeps a conversation's ids where the assistant wrote them and puts
:data:`IGNORE_INDEX` (-100, PyTorch's and ``transformers``' "no target") everywhere else;
:func:`sft_loss` is then chapter 13's next-token loss with those labels as targets: the mean
cross-entropy over the assistant's tokens of the whole batch — TRL's ``SFTTrainer`` with
``assistant_only_loss`` (or ``completion_only_loss``), proven equal in
``tests/test_tuning_sft.py``.

Packing: :func:`pack_examples` puts several conversations in one row (best-fit decreasing, the
rows TRL's ``pack_dataset(strategy="bfd")`` makes), with position ids restarting at 0 where each
one begins, as ``DataCollatorWithFlattening`` and TRL's padding-free collator do.
:func:`packed_logits` runs the book's :class:`~transformer_tutorial.lm.model.LanguageModel` on
such rows with rotary positions from those ids and attention restarted at each boundary (the
block-diagonal causal mask of :func:`document_mask`): each conversation's logits are what it
would get alone.

Shapes: a batch's ``ids``, ``labels`` and ``position_ids`` are ``(B, T)``; logits ``(B, T, V)``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from transformer_tutorial.checks import check_int, check_tensor, check_type
from transformer_tutorial.data import PAD_ID
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.tuning.chat import ChatEncoding

IGNORE_INDEX = -100  # a label that is no target: F.cross_entropy's default ignore_index


@dataclass(frozen=True)
class SFTBatch:
    """Rows of conversations ready for the model and the loss.

    ``ids``, ``labels`` (:data:`IGNORE_INDEX` where nothing is scored) and ``position_ids``
    (restarting at 0 where each conversation begins) are ``(B, T)``; ``rows[b]`` lists the
    indices of the conversations in row ``b``, in order."""

    ids: Tensor
    labels: Tensor
    position_ids: Tensor
    rows: tuple[tuple[int, ...], ...]


def sft_labels(example: ChatEncoding) -> list[int]:
    """The example's ids where its assistant mask is True, :data:`IGNORE_INDEX` elsewhere."""
    check_type("example", example, ChatEncoding, "a ChatEncoding (chat.apply_chat_template)")
    if len(example.ids) != len(example.assistant_mask):
        raise ValueError(
            f"example has {len(example.ids)} ids but {len(example.assistant_mask)} mask entries"
        )
    pairs = zip(example.ids, example.assistant_mask, strict=True)
    return [i if keep else IGNORE_INDEX for i, keep in pairs]


def _check_examples(examples: object) -> None:
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence) or not examples:
        raise ValueError(f"examples must be a non-empty list of ChatEncoding, got {examples!r}")


def pad_examples(examples: Sequence[ChatEncoding], *, pad_id: int = PAD_ID) -> SFTBatch:
    """One conversation a row, padded at the end with ``pad_id`` (labels :data:`IGNORE_INDEX`);
    position ids ``0 .. T - 1`` in every row."""
    _check_examples(examples)
    check_int("pad_id", pad_id, at_least=0)
    labels = [sft_labels(e) for e in examples]
    T = max(len(e.ids) for e in examples)
    ids = [e.ids + [pad_id] * (T - len(e.ids)) for e in examples]
    labels = [row + [IGNORE_INDEX] * (T - len(row)) for row in labels]
    positions = torch.arange(T).expand(len(examples), T)
    rows = tuple((i,) for i in range(len(examples)))
    return SFTBatch(torch.tensor(ids), torch.tensor(labels), positions.clone(), rows)


def best_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Which examples share a row: longest first, each into the row with the least space left
    that still holds it (the earliest such row on a tie), a new row when none does — the rows
    of TRL's ``pack_dataset(strategy="bfd")``. Returns each row's example indices in order."""
    check_int("row_len", row_len, at_least=1)
    for i, length in enumerate(lengths):
        check_int(f"lengths[{i}]", length, at_least=1)
        if length > row_len:
            raise ValueError(f"example {i} has {length} tokens, more than row_len={row_len}")
    rows: list[list[int]] = []
    rows_with_space: dict[int, deque[int]] = defaultdict(deque)  # space left → rows, oldest first
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep order
        fitting = [
            space for space, held in rows_with_space.items() if held and space >= lengths[i]
        ]
        if fitting:
            space = min(fitting)
            row = rows_with_space[space].popleft()
        else:
            space, row = row_len, len(rows)
            rows.append([])
        rows[row].append(i)
        rows_with_space[space - lengths[i]].append(row)
    return rows


def pack_examples(
    examples: Sequence[ChatEncoding], row_len: int, *, pad_id: int = PAD_ID
) -> SFTBatch:
    """Conversations packed into rows of ``row_len`` tokens (:func:`best_fit_decreasing`),
    each row padded at the end with ``pad_id``. Position ids restart at 0 where a conversation
    begins; padding's position ids are 0 (each pad token alone, as TRL pads them), its labels
    :data:`IGNORE_INDEX`. A conversation longer than ``row_len`` is refused."""
    _check_examples(examples)
    check_int("pad_id", pad_id, at_least=0)
    rows = best_fit_decreasing([len(e.ids) for e in examples], row_len)
    ids = torch.full((len(rows), row_len), pad_id)
    labels = torch.full((len(rows), row_len), IGNORE_INDEX)
    positions = torch.zeros((len(rows), row_len), dtype=torch.long)
    for b, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(examples[i].ids)
            ids[b, start : start + n] = torch.tensor(examples[i].ids)
            labels[b, start : start + n] = torch.tensor(sft_labels(examples[i]))
            positions[b, start : start + n] = torch.arange(n)
            start += n
    return SFTBatch(ids, labels, positions, tuple(tuple(row) for row in rows))


def document_mask(position_ids: Tensor) -> Tensor:
    """The block-diagonal causal mask of packed rows, True = attend, ``(B, 1, T, T)``: token
    ``i`` sees token ``j`` when ``j <= i`` and no conversation begins (position id 0) in
    ``(j, i]`` — how ``transformers`` finds packed sequences in ``position_ids``."""
    check_tensor("position_ids", position_ids, kind="int", dims=2, shape="(B, T)")
    document = (position_ids == 0).cumsum(-1)  # (B, T): which conversation each token is in
    same = document[:, :, None] == document[:, None, :]  # (B, T, T)
    T = position_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]  # (B, 1, T, T)


class _DocumentAttention(TorchFunctionMode):
    """Hands every ``F.scaled_dot_product_attention`` call made inside it the packed rows'
    mask in place of its plain causal one."""

    def __init__(self, allowed: Tensor) -> None:
        super().__init__()
        self.allowed, self.calls = allowed, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key = args[0], args[1]
            T = self.allowed.size(-1)
            if kwargs.get("attn_mask") is not None or query.size(-2) != T or key.size(-2) != T:
                raise ValueError(
                    "packed rows need attention over the whole row with no mask of its own "
                    "(no padding mask, no cache, no sliding window)"
                )
            kwargs = {**kwargs, "attn_mask": self.allowed, "is_causal": False}
            self.calls += 1
        return func(*args, **kwargs)


def packed_logits(
    model: LanguageModel, ids: Tensor, position_ids: Tensor, *, logits_at: Tensor | None = None
) -> Tensor:
    """The logits ``(B, T, V)`` of packed rows ``ids`` ``(B, T)``: the model's own layers, with
    rotary positions from ``position_ids`` and each token attending only to the tokens of its
    own conversation (:func:`document_mask`), so that a conversation's logits equal its logits
    alone. Needs rotary positions and attention through ``F.scaled_dot_product_attention``.

    ``logits_at``: flat positions ``(N,)`` into ``B · T``; the output layer then runs there only
    and the result is ``(N, V)`` (training needs the logits where a target is scored, and the
    output layer is a large share of a small model's work)."""
    check_type("model", model, LanguageModel, "a LanguageModel")
    check_tensor("ids", ids, kind="int", dims=2, shape="(B, T)")
    check_tensor("position_ids", position_ids, kind="int", dims=2, shape="(B, T)")
    if position_ids.shape != ids.shape:
        raise ValueError(
            f"position_ids must have ids' shape {tuple(ids.shape)}, "
            f"got {tuple(position_ids.shape)}"
        )
    if model.rotary is None:
        raise ValueError(
            "packed_logits needs positions='rope': a position table added to the embeddings "
            "cannot restart at each conversation"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= model.config.vocab_size:
        raise ValueError(f"ids must be token ids from 0 to {model.config.vocab_size - 1}")
    mode = _DocumentAttention(document_mask(position_ids))
    x = model.positions(model.embed(ids) * model.embed_scale, 0)  # (B, T, D): dropout only
    with mode:
        for layer in model.layers:
            x = layer(x, position_ids=position_ids)
    if mode.calls != len(model.layers):
        raise ValueError(
            f"{mode.calls} of the model's {len(model.layers)} attentions called "
            f"F.scaled_dot_product_attention: packed_logits needs the 'sdpa' backend"
        )
    if logits_at is not None:
        check_tensor("logits_at", logits_at, kind="int", dims=1, shape="(N,)")
        x = x.flatten(0, 1)[logits_at]  # (N, D)
    if model.norm is not None:
        x = model.norm(x)
    return model.lm_head(x)


def sft_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of ``labels[:, t + 1]`` predicted by ``logits[:, t]`` over the
    targets that are not :data:`IGNORE_INDEX` (the assistant's tokens) in the whole batch;
    0 when there are none (as TRL, a finite zero rather than 0 / 0).

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)`` from :func:`sft_labels` (or a batch of them).
    """
    check_tensor("logits", logits, kind="float", dims=3, shape="(B, T, V)")
    check_tensor("labels", labels, kind="int", dims=2, shape="(B, T)")
    if logits.shape[:2] != labels.shape:
        raise ValueError(
            f"logits must be (B, T, V) for labels (B, T) = {tuple(labels.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    targets = labels[:, 1:].flatten()  # (B·(T-1),)
    predictions = logits[:, :-1].flatten(0, 1)  # (B·(T-1), V)
    predictions = predictions.to(torch.promote_types(predictions.dtype, torch.float32))
    total = F.cross_entropy(predictions, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def scored_positions(labels: Tensor) -> tuple[Tensor, Tensor]:
    """Where :func:`sft_loss` scores a target: the flat positions ``(N,)`` into ``B · T`` whose
    logits predict a label that is not :data:`IGNORE_INDEX`, and those labels ``(N,)``. Then
    ``F.cross_entropy(packed_logits(..., logits_at=positions), targets)`` is :func:`sft_loss`
    with the output layer run at ``N`` positions instead of ``B · T``."""
    check_tensor("labels", labels, kind="int", dims=2, shape="(B, T)")
    following = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()  # (B·T,): t + 1
    positions = (following != IGNORE_INDEX).nonzero().squeeze(1)
    return positions, following[positions]
