"""`make bench`: the book's Transformer against PyTorch's ``nn.Transformer``, side by side, in one
process.

    python -m bench                    # CPU, 2 threads, under 10 minutes
    python -m bench --device cuda      # a GPU: bf16 autocast
    python -m bench --quick            # tiny sizes, seconds: the smoke test

Sections:
  1. train step (forward, label-smoothed loss, backward, Adam): throughput ours ÷ nn.Transformer,
     eager (ours with the trainer's cheap dropout masks, ``dropout.with_cheap_dropout``, on a
     CPU where they pay: the table and plot then say so), and compiled vs compiled
     (``torch.compile``, with its compile time), for the models of the ``small`` and ``base``
     recipes at source/target lengths 16, 32 and 64; beside it the model FLOPs utilisation
     (MFU) of each: FLOPs counted by ``FlopCounterMode`` per second, divided by the
     matrix-multiply peak measured in the same run (on a GPU also by the data sheet's peak);
  2. inference forward, the same ratio;
  3. greedy decoding of 16–128 tokens, KV cache ÷ recomputing the prefix every step;
  4. beam 5 vs greedy, sentences/s on test2016, with a trained checkpoint if one is cached;
  5. attention alone, written out (the chapter 3 function) vs fused
     (``F.scaled_dot_product_attention``): time and peak memory as L grows to 2,048;
  6. chapter 17's Llama-style model against ``transformers``' ``LlamaForCausalLM`` of the same
     config, our weights copied in (their "sdpa" attention): throughput ours ÷ theirs of a
     training step (forward, next-token loss, backward, AdamW) at a few batch shapes and of greedy
     generation with a KV cache (ours) vs ``generate(do_sample=False)``, the logits and tokens
     checked equal in float32 first: chapter 17's GPT-2-small-sized capstone (Llama-style,
     153 M weights), on a CPU a step at B=4, T=128 and 128 new tokens at batch 1 and 8;
  7. chapter 20's mixture-of-experts layer against ``transformers``' ``Qwen3MoeSparseMoeBlock``
     with the same weights: throughput ours ÷ theirs of a forward pass and of forward +
     backward, at 8 experts (2 per token) and Qwen3-30B-A3B's 128 (8 per token), the outputs
     checked equal in float32 first;
  8. chapter 21's latent attention: one decoding step after a cache of latents, the absorbed
     form ÷ the unabsorbed one (ratio unabsorbed ÷ absorbed time), outputs checked equal first;
     on a CPU 16 heads of DeepSeek-V3's widths after 2,048 positions, on a GPU its layer; then
     through a one-layer model of those widths, ``LanguageModel.step`` as ``generate()``
     decodes (absorbed) ÷ every layer told to stay unabsorbed, after 1,024 and 4,096;
  9. speculative decoding at batch 1 (chapter 23), section 6's model the target: the speed-up
     over plain greedy decoding and the acceptance rate of two drafts that say what they are
     (the random target agrees with no trained draft): one that proposes the last token again,
     and the target's own first two layers (an early exit); the tokens asserted equal;
 10. the paged cache's overhead: greedy decoding with it ÷ with the preallocated cache,
     section 6's model at batch 1 and 8, the tokens asserted equal;
 11. chapter 22's tiled attention ÷ ``F.scaled_dot_product_attention``, causal, forward and
     forward + backward, at a few lengths, the values checked close (a report: no goal).

The models are those of ``transformer_tutorial.configs.CONFIGS``. Both models share one wrapper
(embeddings, positional encoding, generator), one batch with padding and the same masks. Every
measurement interleaves the two (a busy machine slows both alike) and reports the median of
--repeats after --warmup, with the spread (max - min) / median. Writes
``bench/results/<device>-<torch version>.json`` and a PNG beside it.

Modules: ``cli`` (arguments, settings, the run's description), ``timing`` (interleaved
medians), ``models`` (the ``nn.Transformer`` wrapper, the batch, the timed steps), one module a
section (``train_forward``, ``decoding``, ``beam``, ``attention``, ``llama``, ``moe``,
``mla``, ``speculative``, ``paged``, ``tiled``), ``mfu`` (peaks and utilisation), ``memory``
with the fresh-process probe ``memory_probe``, ``report`` (table, plot, JSON) and
``__main__``.
"""
