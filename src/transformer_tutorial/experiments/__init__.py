"""The measured runs: each a command line (``python -m transformer_tutorial.experiments.NAME``)
that trains and measures language models of :mod:`transformer_tutorial.lm` and writes a record,
committed in the repository's ``results/`` and shipped with the package for the chapters.

- ``harness``: what they share: the record's reader and writer, the validation loss, the one
  time-budgeted training loop (chapter 13's recipe, with an optional auxiliary loss).
- ``comparison`` (chapter 17: GPT-2 style against Llama style at equal weights and time),
  ``length_experiment`` (18: trained short, read long), ``moe_comparison`` and
  ``moe_balancing`` (20: dense against a mixture of experts; DeepSeek-V3's bias balancing),
  ``speculative_comparison`` (23: a draft trained beside its target).

The library never imports this package.
"""
