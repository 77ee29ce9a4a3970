"""Chapter 24: the decoding step compiled, gpt-fast's recipe, added beside the model.

A decoding step at batch 1 is many small calls (each layer's products, norms, rotary,
attention, the cache) driven from Python. gpt-fast compiles the one-token step with
``torch.compile`` so that one graph runs them. :class:`CompiledSteps` does so without editing
:meth:`~transformer_tutorial.lm.model.LanguageModel.step` or
:func:`~transformer_tutorial.lm.sampling.generate`: it is a *view* of a model — the same layers,
weights and buffers, nothing copied — whose ``step`` sends one new position per row with a
cache through the compiled step and every other call (the prompt's step, a forward pass) to the
model's own. ``generate``, speculative decoding and the scheduler take it as they take the
model.

What to expect:

- The first one-token step compiles (seconds for a small model, about a minute for the
  capstone on 2 CPU cores), and the next once more, when the cache's length has become a symbol
  of the graph; later lengths reuse it. Another batch size, cache kind or dtype compiles again.
  The compiled graphs belong to ``LanguageModel.step``'s code: past
  ``torch._dynamo.config.recompile_limit`` graphs (8) in one process, PyTorch warns and runs
  the step eagerly.
- The tokens are the eager step's up to float order — and, for an int8 model, up to its
  arithmetic: under ``torch.compile`` a one-row :class:`~transformer_tutorial.quantization.
  QuantizedLinear` computes with its float32 scales (``_one_row``), where PyTorch's eager int8
  kernel takes them rounded to the activations' dtype.
- It pays where a step is many small calls: batch 1, and an int8 model, whose products the
  compiler fuses into one pass over the weights (``make bench`` section 12). Several rows of an
  int8 model dequantize their weights at every step under ``torch.compile``: slower than eager.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transformer_tutorial.checks import check_type
from transformer_tutorial.lm.cache import LMCache
from transformer_tutorial.lm.model import LanguageModel


class CompiledSteps(LanguageModel):
    """``model`` whose one-token steps run through ``torch.compile`` (see the module); a view
    sharing its modules, weights and buffers, so a change to one is a change to both."""

    def __init__(self, model: LanguageModel) -> None:
        check_type("model", model, LanguageModel, "a LanguageModel")
        if isinstance(model, CompiledSteps):
            raise TypeError("model's steps are compiled already: pass the model itself")
        self.__dict__.update(model.__dict__)  # its modules, weights, buffers and config
        self._compiled_step = torch.compile(super().step)

    def step(
        self,
        ids: Tensor,
        cache: LMCache | None = None,
        *,
        padding_mask: Tensor | None = None,
        check_ids: bool = True,
    ) -> tuple[Tensor, LMCache]:
        """:meth:`LanguageModel.step`; one new position per row after a cache runs compiled,
        its ids' range checked eagerly first (a compiled step skips that read)."""
        if cache is None or not isinstance(ids, Tensor) or ids.dim() != 2 or ids.size(1) != 1:
            return super().step(ids, cache, padding_mask=padding_mask, check_ids=check_ids)
        if check_ids:
            self._check_ids(ids, cache, read_range=True)
        return self._compiled_step(ids, cache, padding_mask=padding_mask, check_ids=False)
