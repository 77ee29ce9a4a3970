"""Chapter 23: prompt lookup — speculative decoding whose draft is the text itself.

When the continuation repeats what is already there (a summary quoting its source, code edited
in place, a model caught in a loop), the tokens that followed the last few tokens the *previous*
time they occurred are a good guess at what follows them now. Prompt lookup (Saxena 2023, in
`transformers` as ``prompt_lookup_num_tokens``) proposes those tokens as the draft; the target
verifies them in one call exactly as in :func:`~transformer_tutorial.lm.speculative.
speculative_generate`'s greedy rule, so the output is the target's greedy output whatever is
proposed — and a proposal costs no model call at all.

Shapes: a prompt ``(1, T0)``; ids are lists of ints.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from transformer_tutorial.checks import check_int
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import check_stop_ids
from transformer_tutorial.lm.speculative import SpeculativeOutput, check_one_prompt, cut_at_eos


def lookup_proposals(ids: Sequence[int], k: int, *, max_ngram: int = 3) -> list[int]:
    """``k`` tokens that continue ``ids`` as the text went on after the latest earlier occurrence
    of its last ``n`` tokens, for the longest ``n`` from ``max_ngram`` down to 1 that occurred
    before; ``[]`` when none did. The copy may run into the tokens it proposes (as LZ77's
    copies do), so a loop of any period is proposed ``k`` tokens ahead."""
    check_int("k", k, at_least=0)
    check_int("max_ngram", max_ngram, at_least=1)
    if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
        raise TypeError(f"ids must be a list of int token ids (tensor.tolist()), got {ids!r:.60}")
    ids = list(ids)
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        tail = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):  # latest first, never the tail itself
            if ids[start : start + n] == tail:
                text = ids.copy()
                for i in range(start + n, start + n + k):
                    text.append(text[i])
                return text[len(ids) :]
    return []


@torch.no_grad()
def prompt_lookup_generate(
    target: LanguageModel,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    k: int,
    max_ngram: int = 3,
    eos_id: int | None = None,
) -> SpeculativeOutput:
    """Greedy decoding of ``prompt`` ``(1, T0)`` by up to ``max_new_tokens`` tokens of
    ``target``, each round verifying up to ``k`` tokens proposed by :func:`lookup_proposals`
    in one call: the tokens :func:`~transformer_tutorial.lm.sampling.generate` gives greedily.
    A round with nothing to propose is a plain step. The cache is preallocated and rewound past
    the rejected proposals."""
    check_one_prompt(target, prompt, max_new_tokens, k)
    check_int("max_ngram", max_ngram, at_least=1)
    check_stop_ids(target, eos_id=eos_id)
    ids, total, device = prompt[0].tolist(), prompt.size(1) + max_new_tokens, prompt.device
    cache = target.new_cache(1, "preallocated", max_len=total)
    pending = ids  # the tokens the cache has not read yet
    proposed = accepted = calls = 0
    while len(ids) < total:
        # 1) propose from the text itself; 2) the target reads them all in one call
        proposals = lookup_proposals(ids, min(k, total - len(ids) - 1), max_ngram=max_ngram)
        logits, cache = target.step(torch.tensor([pending + proposals], device=device), cache)
        best = logits[0, len(pending) - 1 :].argmax(-1).tolist()  # after each proposal
        calls += 1
        # 3) accept while the proposal is the target's token; the target's token follows
        n = 0
        while n < len(proposals) and proposals[n] == best[n]:
            n += 1
        ids = ids + cut_at_eos([*proposals[:n], best[n]], eos_id)
        proposed, accepted = proposed + len(proposals), accepted + n
        if eos_id is not None and ids[-1] == eos_id:
            break
        # 4) the cache forgets the rejected proposals
        cache.rewind(len(proposals) - n)
        pending = [best[n]]
    return SpeculativeOutput(torch.tensor([ids], device=device), proposed, accepted, calls)
