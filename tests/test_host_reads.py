"""The hot loops read back from the device only what they need, pinned by count: a training
step reads nothing, greedy decoding reads the source's id range once and "has every sentence
finished?" once a step, and translating reads each batch's tokens once; the language model's
generation reads the prompt's id range once, then nothing a token without a stop id and one
read a token with one.

On a GPU each read back (``.item()``, ``.tolist()``, ``bool(tensor)``, ...) makes the host wait
until the queue of work drains. PyTorch's own detector (``torch.cuda.set_sync_debug_mode``) works
on CUDA only, so these tests count the reads on the CPU by wrapping the Tensor methods that
make them: the same code path reads the same number of times on any device.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from transformer_tutorial.checkpoint import load_model
from transformer_tutorial.configs import CONFIGS, RunOptions
from transformer_tutorial.data import BOS_ID, EOS_ID, PAD_ID
from transformer_tutorial.decode import beam_search, greedy_decode, translate_sentences
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.model import Transformer
from transformer_tutorial.trainer import Trainer

IDS = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
# The Tensor methods that copy a value from the device to the host.
READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def host_reads() -> Iterator[Counter]:
    """Count the reads back to the host inside the block, by method name."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, method):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return method(self, *args, **kwargs)

        return read

    for name, method in originals.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield counts
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def test_the_counter_sees_every_kind_of_read():
    x = torch.tensor([1.0, 2.0])
    with host_reads() as counts:
        x[0].item()
        x.tolist()
        x.numpy()
        int(x[0])
        float(x[0])
        [10, 20][x.long()[0]]  # __index__
        if (x > 0).all():  # __bool__
            pass
    assert counts == Counter(READS)  # each name once


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request) -> Iterator[int]:
    """Run the test on 1 and on 2 torch threads (the session's setting is given back)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_a_training_step_reads_nothing_back(digit_reversal, tmp_path, threads):
    config = replace(CONFIGS["tiny"], max_tokens=60)
    pairs = digit_reversal.pairs(16, seed=1)
    model = Transformer(config.model_config(13))
    trainer = Trainer(
        model, config, pairs, pairs[:4], folder=tmp_path, options=RunOptions(progress=False)
    )
    batch = list(range(8))
    trainer.train_step(batch)  # the optimizer's state is made at its first step
    with host_reads() as counts:
        loss_sum, tokens = trainer.train_step(batch)
    assert sum(counts.values()) == 0, counts
    assert tokens.item() == sum(len(pairs[i][1]) + 1 for i in batch)  # read when wanted
    assert loss_sum.item() > 0


def silent_model(tiny_model, seed: int) -> torch.nn.Module:
    """A model that never writes <eos>, so decoding runs its whole budget."""
    model = tiny_model(seed=seed)
    with torch.no_grad():
        model.generator.bias[EOS_ID] = -1e4
    return model


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_decoding_reads_once_a_step_and_the_source_once(tiny_model, seed, use_cache):
    model = silent_model(tiny_model, seed)
    src = torch.tensor([[5, 6, 7, 8], [9, 10, PAD_ID, PAD_ID]])
    with host_reads() as counts:
        out = greedy_decode(model, src, max_len=20, use_cache=use_cache, **IDS)
    assert out.size(1) == 20
    assert counts == Counter(tolist=1, __bool__=20)  # the ids' range; "all finished?" a step


def test_beam_search_reads_once_a_step_and_the_source_and_the_width_once(tiny_model):
    model = silent_model(tiny_model, 0)
    src = torch.tensor([[5, 6, 7, 8], [9, 10, PAD_ID, PAD_ID]])
    with host_reads() as counts:
        beam_search(model, src, beam_size=3, max_len=12, **IDS)
    # the ids' range, "any beam alive?" a step, the longest hypothesis's length at the end
    assert counts == Counter(tolist=1, __bool__=12, __int__=1)


def test_translating_reads_each_batchs_tokens_once(tiny_checkpoint):
    model, tokenizer, _ = load_model(tiny_checkpoint)
    with torch.no_grad():
        model.generator.bias[EOS_ID] = -1e4
    with host_reads() as counts:
        out = translate_sentences(
            model, tokenizer, ["Ein Mann.", "Zwei Hunde.", "Ein Buch."], max_len=6
        )
    assert len(out) == 3
    assert counts == Counter(tolist=2, __bool__=6)  # the ids' range and the tokens; 6 steps


LM_KINDS = {
    "gpt2": {},
    "qwen3": dict(QWEN3, n_kv_heads=2),
    "mla": dict(
        LLAMA,
        attention="mla",
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
    ),
}


def lm(kind: str, seed: int) -> LanguageModel:
    """A 4-layer language model of the given kind."""
    torch.manual_seed(seed)
    config = LMConfig(
        vocab_size=30,
        d_model=16,
        n_heads=4,
        n_layers=4,
        d_ff=32,
        max_len=40,
        dropout=0.0,
        **LM_KINDS[kind],
    )
    return LanguageModel(config).eval()


@pytest.mark.parametrize("cache_kind", ["growing", "preallocated"])
@pytest.mark.parametrize("kind", LM_KINDS)
def test_generating_reads_the_prompt_once_and_nothing_a_token_without_a_stop_id(kind, cache_kind):
    """gpt-fast's decoding reads nothing back: neither do ours, on any attention or cache kind,
    whatever the depth (the rotary tables are looked up without a range check a layer)."""
    model, prompt = lm(kind, 0), torch.tensor([[1, 2, 3], [4, 5, 6]])
    with host_reads() as counts:
        out = generate(model, prompt, 20, greedy=True, cache_kind=cache_kind)
    assert out.shape == (2, 23)
    assert counts == Counter(tolist=1)  # the prompt's id range


@pytest.mark.parametrize("kind", LM_KINDS)
def test_generating_with_a_stop_id_reads_once_a_token(kind):
    model, prompt = lm(kind, 1), torch.tensor([[1, 2, 3], [4, 5, 6]])
    free = generate(model, prompt, 20, greedy=True)
    never = min(set(range(30)) - set(free[:, 3:].flatten().tolist()))  # a stop id never made
    with host_reads() as counts:
        out = generate(model, prompt, 20, greedy=True, eos_id=never)
    assert torch.equal(out, free)
    # the prompt's id range, then "has every row finished?" after each of the first 19 tokens
    assert counts == Counter(tolist=1, __bool__=19)
