"""The language model: the decoder alone (chapter 13) with today's pieces (14-25).

Imports run one way, from the config at the bottom up to the model and what uses it:

- ``registry``: the registries a config string is looked up in (``ATTENTIONS``, ``POSITIONS``,
  ``ATTENTION_KERNELS``, ``ROUTERS``, ``CACHE_KINDS``); each piece registers itself in its own
  module, so a new piece is a module and one ``register`` line.
- ``config``: :class:`LMConfig` and the ``LLAMA``/``QWEN3`` presets; imports only the
  registries (and ``rope_scaling``'s spec), none of the modules below.
- the pieces: ``rotary`` (chapter 15) and ``rope_scaling`` (18), ``cache`` (one layer's cache
  over the layout its attention declares: growing or preallocated, in place, rewindable),
  ``grouped_attention`` (16), ``latent_attention`` (21), ``moe`` (20), ``tiled_attention`` (22);
  ``pieces`` holds the factories and chapter 13's and 15's pieces, ``layer`` the decoder-only
  layer, ``model`` the :class:`LanguageModel`.
- decoding: ``sampling`` (temperature, top-k, top-p, ``generate``), ``paged_cache`` (23: a paged
  cache, continuous batching), ``speculative`` (23: a draft model proposes, the target verifies).
- weights: ``gpt2_weights``, ``hf_weights`` (Llama, Qwen3), ``moe_weights`` (Qwen3-MoE),
  ``deepseek_weights`` (DeepSeek-V3, dense or with its mixture of experts), ``pretrained``
  (checkpoint folders, chapter 19, over ``checkpoint_files``: the folder's files themselves).
- ``sharding`` (chapter 25): the model sharded across processes with FSDP2.

The measured runs of chapters 17–23 live apart, in :mod:`transformer_tutorial.experiments`.
"""
