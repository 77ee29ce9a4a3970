"""Section 9: speculative decoding at batch 1, the speed-up over the target's plain greedy
decoding (:func:`~transformer_tutorial.lm.sampling.generate`), with the acceptance rate.

The target is section 6's model with random weights (seed 0), so no trained draft agrees with
it: a draft that shares nothing with it is accepted almost never. Two drafts, both honest about
what they are, bracket the speed-up:

- ``copy``: proposes the last token again. It is a language model of one layer whose weights
  are all zero (the layer adds nothing to the residual stream) and whose output layer is its
  own embedding table (tied), so the most likely next token is the one it read; that is
  checked before any timing. It costs little next to the target, and it is accepted as often
  as the target repeats itself, which these random weights do (``target_repeat_rate``): a
  trained model repeats less.
- ``first_layers``: the target's own first layers, with its embedding, final norm and output
  layer (an early exit, as LayerSkip drafts): it shares the target's weights, costs a share of
  each target step, and with random weights agrees with it hardly ever.
- ``prompt_lookup``: no model at all: the tokens that followed the text's last n-gram the time
  before (:func:`~transformer_tutorial.lm.prompt_lookup.prompt_lookup_generate`, up to
  :data:`LOOKUP_K` a round). A proposal costs nothing; it is accepted where the target repeats
  text it has produced, as these random weights do once they fall into a loop.

Then prompt lookup where it is meant to pay, on text that repeats: chapter 23's small Llama-style
model trained to copy (:func:`copy_model`: 16 random tokens out of 64, then the same 16), asked
for 16 tokens after 16 held-out ones, :data:`COPY_ROWS` rows one after another, plain greedy
decoding against prompt lookup (tokens asserted equal first).

Greedy speculative decoding gives the target's greedy tokens whatever the draft proposes: the
tokens are asserted equal to plain decoding's before any timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.cli import Settings
from bench.llama import MODELS
from bench.timing import interleaved
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.prompt_lookup import prompt_lookup_generate
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.lm.speculative import speculative_generate

PLAIN = "plain greedy"
# (prompt length, new tokens, the copy draft's width, the early exit's layers): --quick, full.
SHAPES = {"quick": (4, 8, 32, 1), "full": (8, 64, 128, 2)}
DRAFTS = {
    "copy": "proposes the last token again: 1 layer of zero weights, D={width}, tied embeddings; "
    "shares nothing with the target",
    "first_layers": "the target's first {layers} of {n_layers} layers, with its embedding, final "
    "norm and output layer (an early exit)",
    "prompt_lookup": "no model: what followed the text's last 3-gram (or 2, 1) the time before",
}
LOOKUP_K = 8  # tokens prompt lookup proposes a round at most: they cost nothing to propose
COPY_V, COPY_L = 64, 16  # the copy task: vocabulary, length of each half
COPY_STEPS = {"quick": 20, "full": 300}  # its training steps (300: every held-out row copied)
COPY_ROWS = 16  # held-out rows decoded in each timed run


def copy_draft(target: LanguageModel, width: int) -> LanguageModel:
    """A draft whose most likely next token is the one it read (see the module)."""
    config = LMConfig(
        vocab_size=target.config.vocab_size,
        d_model=width,
        n_heads=2,
        n_layers=1,
        d_ff=width,
        max_len=target.config.max_len,
        dropout=0.0,
        **(LLAMA | dict(n_kv_heads=1, tie_embeddings=True)),
    )
    torch.manual_seed(1)
    draft = LanguageModel(config).to(target.lm_head.weight.device).eval()
    with torch.no_grad():
        for p in draft.layers.parameters():
            p.zero_()
    return draft


def first_layers_draft(target: LanguageModel, layers: int) -> LanguageModel:
    """The target cut after ``layers`` layers: the same embedding, layers, norm and head."""
    draft = LanguageModel(replace(target.config, n_layers=layers))
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    if missing:
        raise RuntimeError(f"the early exit lacks the target's {missing}")
    return draft.to(target.lm_head.weight.device).eval()


def copies_its_input(draft: LanguageModel, device: torch.device, n: int = 256) -> bool:
    """Whether the copy draft's most likely token after each of ``n`` ids is that id."""
    ids = torch.linspace(0, draft.config.vocab_size - 1, n).long().to(device)[:, None]  # (n, 1)
    with torch.no_grad():
        return bool(torch.equal(draft(ids)[:, -1].argmax(-1), ids[:, 0]))


def _fns(
    target: LanguageModel, drafts: dict, prompt: Tensor, n: int, k: int
) -> dict[str, Callable[[], Tensor]]:
    fns = {PLAIN: lambda: generate(target, prompt, n, greedy=True)}
    for name, draft in drafts.items():
        fns[name] = lambda d=draft: speculative_generate(target, d, prompt, n, k=k, greedy=True)
    fns["prompt_lookup"] = lambda: prompt_lookup_generate(target, prompt, n, k=LOOKUP_K)
    return fns


def copy_model(steps: int, device: torch.device) -> LanguageModel:
    """Chapter 23's copy model: a small Llama-style model trained ``steps`` steps (AdamW, batch
    32) to repeat 16 random tokens of 64."""
    torch.manual_seed(0)
    config = LMConfig(
        vocab_size=COPY_V, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_len=2 * COPY_L,
        dropout=0.0, **LLAMA,
    )  # fmt: skip
    model = LanguageModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, COPY_V, (32, COPY_L), generator=gen)
        ids = torch.cat([x, x], dim=1).to(device)  # (32, 2L)
        logits = model(ids)[:, COPY_L - 1 : -1]  # the predictions of the second half
        loss = F.cross_entropy(logits.reshape(-1, COPY_V), ids[:, COPY_L:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def copy_rows(s: Settings, device: torch.device) -> dict:
    """Prompt lookup on the copy model: plain greedy and lookup timed in turns."""
    steps = COPY_STEPS["quick" if s.quick else "full"]
    model = copy_model(steps, device)
    gen = torch.Generator().manual_seed(99)
    prompts = [
        torch.randint(0, COPY_V, (1, COPY_L), generator=gen).to(device) for _ in range(COPY_ROWS)
    ]
    fns = {
        PLAIN: lambda: [generate(model, p, COPY_L, greedy=True) for p in prompts],
        "prompt_lookup": lambda: [
            prompt_lookup_generate(model, p, COPY_L, k=LOOKUP_K) for p in prompts
        ],
    }
    plain, looked = fns[PLAIN](), fns["prompt_lookup"]()
    same = all(torch.equal(a, b.ids) for a, b in zip(plain, looked, strict=True))
    assert same, "prompt lookup changed the copy model's greedy tokens"
    copied = sum(torch.equal(a[0, COPY_L:], p[0]) for a, p in zip(plain, prompts, strict=True))
    timed = interleaved(fns, s.llama_repeats, s.warmup_after_check(), device)
    row = {
        "train_steps": steps,
        "rows": COPY_ROWS,
        "rows_copied": copied,
        "new_tokens": COPY_ROWS * COPY_L,
        "target_calls": sum(o.target_calls for o in looked),
        "acceptance_rate": sum(o.accepted for o in looked)
        / max(sum(o.proposed for o in looked), 1),
        "plain_ms": 1e3 * timed[PLAIN]["median_s"],
        "lookup_ms": 1e3 * timed["prompt_lookup"]["median_s"],
        "speedup": timed[PLAIN]["median_s"] / timed["prompt_lookup"]["median_s"],
        "same_tokens": same,
    }
    print(
        f"  prompt lookup on a model trained {steps} steps to copy ({copied} of {COPY_ROWS} rows "
        f"copied): {row['target_calls']} target calls for {row['new_tokens']} tokens, "
        f"{row['lookup_ms']:.1f} ms vs plain {row['plain_ms']:.1f} ms, speed-up "
        f"{row['speedup']:.2f} (tokens the same)",
        flush=True,
    )
    return row


def bench_speculative(s: Settings, device: torch.device) -> dict:
    """Section 9: each draft's tokens checked equal to plain greedy decoding's (that run is
    the first untimed one), then the three decoders timed in turns."""
    prompt_len, n, width, layers = SHAPES["quick" if s.quick else "full"]
    config = MODELS[s.llama_config]
    torch.manual_seed(0)
    target = LanguageModel(config).to(device).eval()
    drafts = {
        "copy": copy_draft(target, width),
        "first_layers": first_layers_draft(target, layers),
    }
    if not copies_its_input(drafts["copy"], device):
        raise RuntimeError("the copy draft does not propose the token it read")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=gen).to(device)
    fns = _fns(target, drafts, prompt, n, s.draft_k)
    plain = fns[PLAIN]()
    new = plain[0, prompt_len - 1 :]  # the prompt's last token, then the generated ones
    repeat_rate = (new[1:] == new[:-1]).double().mean().item()
    outs = {name: fns[name]() for name in [*drafts, "prompt_lookup"]}
    timed = interleaved(fns, s.llama_repeats, s.warmup_after_check(), device)
    rows = []
    for name, out in outs.items():
        row = {
            "draft": name,
            "draft_is": DRAFTS[name].format(width=width, layers=layers, n_layers=config.n_layers),
            "draft_weights": drafts[name].num_parameters() if name in drafts else 0,
            "k": s.draft_k if name in drafts else LOOKUP_K,
            "acceptance_rate": out.acceptance_rate,
            "target_calls": out.target_calls,
            "plain_ms": 1e3 * timed[PLAIN]["median_s"],
            "speculative_ms": 1e3 * timed[name]["median_s"],
            "plain_spread": timed[PLAIN]["spread"],
            "speculative_spread": timed[name]["spread"],
            "speedup": timed[PLAIN]["median_s"] / timed[name]["median_s"],
            "same_tokens": bool(torch.equal(out.ids, plain)),
        }
        assert row["same_tokens"], f"speculative decoding with the {name} draft changed tokens"
        rows.append(row)
        print(
            f"  {name:<13} draft ({row['draft_weights']:,} weights), k={row['k']}: accepted "
            f"{row['acceptance_rate']:.0%}, {row['target_calls']} target calls for {n} tokens; "
            f"{row['speculative_ms']:8.1f} ms vs plain {row['plain_ms']:8.1f} ms  speed-up "
            f"{row['speedup']:.2f}  (tokens the same)",
            flush=True,
        )
    print(f"  the target repeats its previous token in {repeat_rate:.0%} of its steps")
    return {
        "config": s.llama_config,
        "target_weights": target.num_parameters(),
        "batch": 1,
        "prompt": prompt_len,
        "new_tokens": n,
        "target_repeat_rate": repeat_rate,
        "rows": rows,
        "copy_task": copy_rows(s, device),
    }
