"""Transformer, piece by piece: the encoder–decoder Transformer of Vaswani et al. (2017).

The model, one module per idea, in the chapters' order: ``embeddings`` (chapters 1–2),
``attention`` (3–4), ``layers`` (5, 7, 8), ``masks`` (6), ``stacks`` (7–8), ``model`` (9);
``copy_weights`` copies PyTorch's weights into them for the equality checks. Imports run one
way: ``embeddings``, ``masks`` → ``attention`` → ``layers`` → ``stacks`` → ``model``.

The training side (chapter 10), one job a module, none of which the model imports:
``multi30k`` (the corpus's files and splits), ``data`` (tokenizer, batches), ``optim`` (loss,
optimizer, schedule), ``configs`` (the named recipes), ``checkpoint`` (save, load, average),
``pair_loss`` (the loss on translation pairs), ``trainer`` (the loop), ``train_state`` (where
training stands), ``budget`` (when it stops; the last step a time limit holds), ``run_folder``
(a run's files), ``runs`` (a whole run, the runs cache), ``records`` (what a run was and how it
went), ``provenance`` (where it ran, from which commit); ``decode`` (chapter 11: greedy, beam
search, BLEU). The command lines are ``train`` and ``translate``; ``runtime`` picks the device
and seeds. Chapter 12 adds ``precision`` (fp32, bf16 or fp16 with loss scaling),
``distributed`` (many processes under ``torchrun``) and ``dropout`` (dropout masks from a
quarter of the random draws, on a CPU), which the trainer uses.

From 2017 to today (chapters 13–17) and the pieces no tutorial proves (18–25): the language model
lives in the subpackage ``lm`` (see its docstring), built from the 2017 pieces above and a few
shared ones that stay here: ``norms`` (RMSNorm), ``feed_forward`` (SwiGLU), ``flops`` (a step's
floating-point operations), ``checks`` (argument validation, the command lines' flags),
``versions`` (what a chapter's setup cell requires installed), ``plotting`` (the book's figures),
``tiled_attention`` (chapter 22: the online softmax, FlashAttention-2's tiled forward and
backward), ``quantization`` and ``lora`` (chapter 24: weight-only int8/int4 layers, a low-rank
update beside frozen weights). The measured runs of chapters 17–23 (command lines that train and
time language models and write the records the chapters read) live apart from the library, in
the subpackage ``experiments``; their records are kept in the repository's ``results/`` and
shipped inside the package (``records.shipped_record``).

Shape vocabulary, batch-first everywhere:

====  =========================================
B     batch size
S     source length (encoder side)
T     target length (decoder side)
D     ``d_model``, the width of every residual stream
H     number of attention heads
Dh    ``D // H``, the width of one head
V     vocabulary size
====  =========================================

Mask polarity lives in the name and follows PyTorch's modules: every ``*_key_padding_mask`` is a
bool ``(B, L)`` tensor with True = padding (ignore), and every ``attn_mask`` is bool with
True = blocked. ``torch.nn.functional.scaled_dot_product_attention`` reads a bool mask the other
way round (True = attend); :func:`transformer_tutorial.masks.merge_masks` is the one place that
builds what attention consumes.
"""

from transformer_tutorial.runtime import get_device, set_seed

__version__ = "0.1.0"

__all__ = ["__version__", "get_device", "set_seed"]
