"""Chapter 26's fine-tuning loss and packing: the masked loss equal to TRL's SFTTrainer loss
(assistant-only and completion-only), packed rows equal to TRL's, and packed logits, loss and
gradients equal to the unpacked ones in float64."""

import copy

import pytest
import torch

from transformer_tutorial import data
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.tuning.chat import (
    CHAT_TEMPLATE,
    add_chat_tokens,
    apply_chat_template,
    translation_chat,
)
from transformer_tutorial.tuning.sft import (
    IGNORE_INDEX,
    best_fit_decreasing,
    document_mask,
    pack_examples,
    packed_logits,
    pad_examples,
    scored_positions,
    sft_labels,
    sft_loss,
)

SENTENCES = ["Ein Hund läuft.", "A dog runs.", "Zwei Männer spielen Fußball.", "Two men play."] * 5
PAIRS = [
    ("Ein Hund läuft.", "A dog runs."),
    ("Zwei Männer.", "Two men play football on grass."),
    ("Hund", "dog"),
    ("Fußball spielen Männer.", "Men play."),
    ("Ein.", "A."),
    ("Zwei Hunde spielen.", "Two dogs play football."),
]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = data.train_tokenizer(SENTENCES, vocab_size=100)
    add_chat_tokens(tokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def conversations():
    return [translation_chat(german, english) for german, english in PAIRS]


@pytest.fixture(scope="module")
def examples(tokenizer, conversations):
    return [apply_chat_template(tokenizer, c) for c in conversations]


def make_model(vocab_size: int, seed: int = 0, **changes) -> LanguageModel:
    torch.manual_seed(seed)
    sizes = dict(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64, max_len=128)
    config = LMConfig(vocab_size=vocab_size, dropout=0.0, **(LLAMA | sizes | changes))
    return LanguageModel(config).double().eval()


def test_labels_and_loss_by_hand(examples):
    example = examples[0]
    labels = sft_labels(example)
    assert [i for i, m in zip(example.ids, example.assistant_mask, strict=True) if m] == [
        label for label in labels if label != IGNORE_INDEX
    ]
    batch = pad_examples(examples[:3])
    logits = torch.randn(*batch.ids.shape, 104, dtype=torch.float64)
    log_p = logits[:, :-1].log_softmax(-1)
    targets = batch.labels[:, 1:]
    scored = targets != IGNORE_INDEX
    by_hand = -log_p.gather(-1, targets.clamp(min=0)[..., None])[..., 0][scored].mean()
    torch.testing.assert_close(sft_loss(logits, batch.labels), by_hand, rtol=0, atol=1e-12)
    # chapter 13's next-token loss with the labels as targets
    torch.testing.assert_close(
        sft_loss(logits, batch.labels),
        next_token_loss(logits, batch.labels, ignore_index=IGNORE_INDEX).double(),
        rtol=0,
        atol=1e-6,
    )
    nothing = torch.full_like(batch.labels, IGNORE_INDEX)
    assert sft_loss(logits, nothing).item() == 0.0  # finite, as TRL's


def test_loss_of_bf16_logits_is_computed_in_float32(examples):
    batch = pad_examples(examples[:3])
    logits = torch.randn(*batch.ids.shape, 104).bfloat16()
    loss = sft_loss(logits, batch.labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, sft_loss(logits.float(), batch.labels), rtol=0, atol=0)


def test_document_mask_by_hand():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(document_mask(position_ids), expected[None, None])


def test_best_fit_decreasing_by_hand():
    # longest first; 5 goes where it leaves least space (row 1: 10 - 4), ties keep order
    assert best_fit_decreasing([7, 4, 5, 3, 3], 10) == [[0, 3], [2, 1], [4]]
    assert best_fit_decreasing([10, 10], 10) == [[0], [1]]
    with pytest.raises(ValueError, match="example 1 has 11 tokens, more than row_len=10"):
        best_fit_decreasing([3, 11], 10)


def unpacked_pieces(batch, logits, examples):
    """Each conversation's logits from the packed rows, in example order."""
    pieces = {}
    for b, row in enumerate(batch.rows):
        start = 0
        for i in row:
            n = len(examples[i].ids)
            pieces[i] = logits[b, start : start + n]
            start += n
    return [pieces[i] for i in range(len(examples))]


@pytest.mark.parametrize("row_len", [49, 64, 80, 120, 400])
@pytest.mark.parametrize("changes", [{}, dict(n_kv_heads=4, tie_embeddings=True)])
def test_packed_equals_unpacked_in_float64(examples, tokenizer, row_len, changes):
    model = make_model(tokenizer.get_vocab_size(), **changes)
    padded = pad_examples(examples)
    packed = pack_examples(examples, row_len)
    assert sorted(i for row in packed.rows for i in row) == list(range(len(examples)))
    logits = model(padded.ids)
    pieces = unpacked_pieces(
        packed, packed_logits(model, packed.ids, packed.position_ids), examples
    )
    for i, piece in enumerate(pieces):
        torch.testing.assert_close(piece, logits[i, : len(examples[i].ids)], rtol=0, atol=1e-12)
    loss = sft_loss(logits, padded.labels)
    packed_loss = sft_loss(packed_logits(model, packed.ids, packed.position_ids), packed.labels)
    torch.testing.assert_close(packed_loss, loss, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    packed_grads = torch.autograd.grad(packed_loss, list(model.parameters()))
    for g, packed_g in zip(grads, packed_grads, strict=True):
        torch.testing.assert_close(packed_g, g, rtol=0, atol=1e-12)


def test_logits_at_the_scored_positions_give_the_same_loss(examples, tokenizer):
    model = make_model(tokenizer.get_vocab_size())
    packed = pack_examples(examples, 80)
    logits = packed_logits(model, packed.ids, packed.position_ids)
    positions, targets = scored_positions(packed.labels)
    assert len(targets) == int((packed.labels[:, 1:] != IGNORE_INDEX).sum())
    at = packed_logits(model, packed.ids, packed.position_ids, logits_at=positions)
    torch.testing.assert_close(at, logits.flatten(0, 1)[positions], rtol=0, atol=1e-12)
    torch.testing.assert_close(
        torch.nn.functional.cross_entropy(at, targets),
        sft_loss(logits, packed.labels),
        rtol=0,
        atol=1e-12,
    )


def test_a_row_filled_exactly(examples, tokenizer):
    lengths = [len(e.ids) for e in examples]
    row_len = lengths[0] + lengths[2]  # rows 0 and 2 fill one row with no padding
    packed = pack_examples(examples, row_len)
    full = [b for b, row in enumerate(packed.rows) if sum(lengths[i] for i in row) == row_len]
    assert full, packed.rows
    model = make_model(tokenizer.get_vocab_size(), seed=1)
    logits = model(pad_examples(examples).ids)
    pieces = unpacked_pieces(
        packed, packed_logits(model, packed.ids, packed.position_ids), examples
    )
    for i, piece in enumerate(pieces):
        torch.testing.assert_close(piece, logits[i, : lengths[i]], rtol=0, atol=1e-12)


def test_one_row_each_is_the_model_itself(examples, tokenizer):
    model = make_model(tokenizer.get_vocab_size())
    padded = pad_examples(examples)
    torch.testing.assert_close(
        packed_logits(model, padded.ids, padded.position_ids), model(padded.ids), rtol=0, atol=0
    )


def test_packing_without_the_mask_would_differ(examples, tokenizer):
    """The check has teeth: restarting the positions alone, without restarting attention,
    changes every conversation after the first in a row."""
    model = make_model(tokenizer.get_vocab_size())
    packed = pack_examples(examples, 120)
    with torch.no_grad():
        x = model.embed(packed.ids)
        for layer in model.layers:
            x = layer(x, position_ids=packed.position_ids)
        leaky = model.lm_head(model.norm(x))
    assert (leaky - packed_logits(model, packed.ids, packed.position_ids)).abs().max() > 1e-3


def test_refusals(examples, tokenizer):
    with pytest.raises(ValueError, match="more than row_len"):
        pack_examples(examples, 10)
    gpt = LanguageModel(LMConfig(vocab_size=tokenizer.get_vocab_size(), d_model=16, n_heads=2))
    packed = pack_examples(examples, 120)
    with pytest.raises(ValueError, match="positions='rope'"):
        packed_logits(gpt, packed.ids, packed.position_ids)
    model = make_model(tokenizer.get_vocab_size())
    with pytest.raises(ValueError, match="position_ids must have ids' shape"):
        packed_logits(model, packed.ids, packed.position_ids[:, :-1])
    tiled = make_model(tokenizer.get_vocab_size(), attention_backend="tiled")
    with pytest.raises(ValueError, match="'sdpa' backend"):
        packed_logits(tiled, packed.ids, packed.position_ids)
    with pytest.raises(ValueError, match="labels"):
        sft_loss(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="non-empty list"):
        pad_examples([])


# --- TRL: the same loss from SFTTrainer.compute_loss on a transformers Llama ---------------


def trl_trainer(tokenizer, model, dataset, tmp_path, **settings):
    """An SFTTrainer on a transformers Llama holding ``model``'s weights (float64)."""
    pytest.importorskip("trl", reason="the [trl] extra compares with TRL's SFTTrainer")
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from transformer_tutorial.lm.hf_weights import copy_to_llama, llama_config

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(tokenizer),
        bos_token="<bos>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    llama = LlamaForCausalLM(llama_config(model.config)).double().eval()
    copy_to_llama(model, llama)
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings)
    trainer = SFTTrainer(
        model=llama,
        args=args,
        train_dataset=Dataset.from_list(dataset),
        processing_class=hf_tokenizer,
    )
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    return trainer, rows


@pytest.mark.parametrize("changes", [{}, dict(n_kv_heads=4, tie_embeddings=True, n_layers=3)])
def test_masked_loss_equals_trl_assistant_only_loss(
    tokenizer, conversations, examples, tmp_path, changes
):
    model = make_model(tokenizer.get_vocab_size(), seed=2, **changes)
    dataset = [{"messages": c} for c in conversations]
    trainer, rows = trl_trainer(
        tokenizer, model, dataset, tmp_path, assistant_only_loss=True, max_length=400
    )
    assert [row["input_ids"] for row in rows] == [e.ids for e in examples]
    assert [row["labels"] for row in rows] == [sft_labels(e) for e in examples]
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
    batch = pad_examples(examples)
    ours = sft_loss(model(batch.ids), batch.labels)
    # TRL scores in float32: equal to ours within float32's rounding (relative 1e-6)
    torch.testing.assert_close(theirs.double(), ours, rtol=1e-6, atol=1e-6)


def test_masked_loss_equals_trl_completion_only_loss(tokenizer, conversations, examples, tmp_path):
    model = make_model(tokenizer.get_vocab_size(), seed=3)
    dataset = [{"prompt": c[:1], "completion": c[1:]} for c in conversations]
    trainer, rows = trl_trainer(
        tokenizer, model, dataset, tmp_path, completion_only_loss=True, max_length=400
    )
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
    batch = pad_examples(examples)
    torch.testing.assert_close(
        theirs.double(), sft_loss(model(batch.ids), batch.labels), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("row_len", [64, 80])
def test_packing_equals_trl_bfd_and_padding_free_loss(
    tokenizer, conversations, examples, tmp_path, row_len
):
    model = make_model(tokenizer.get_vocab_size(), seed=4)
    dataset = [{"messages": c} for c in conversations]
    trainer, rows = trl_trainer(
        tokenizer,
        model,
        dataset,
        tmp_path,
        assistant_only_loss=True,
        packing=True,
        packing_strategy="bfd",
        max_length=row_len,
    )
    packed = pack_examples(examples, row_len)
    # the same rows: TRL's packed rows are ours without the padding
    assert [row["seq_lengths"] for row in rows] == [
        [len(examples[i].ids) for i in row] for row in packed.rows
    ]
    for row, ids, labels in zip(rows, packed.ids, packed.labels, strict=True):
        n = len(row["input_ids"])
        assert row["input_ids"] == ids[:n].tolist() and row["labels"] == labels[:n].tolist()
    batch = trainer.data_collator(rows)  # padding-free: every row in one, position ids restart
    theirs = trainer.compute_loss(trainer.model, dict(batch))
    ours = sft_loss(packed_logits(model, packed.ids, packed.position_ids), packed.labels)
    torch.testing.assert_close(theirs.double(), ours, rtol=1e-6, atol=1e-6)
    # transformers' Llama finds the packed sequences in position_ids: the same logits
    with torch.no_grad():
        hf_logits = trainer.model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"]
        ).logits[0]
    real = torch.cat(
        [
            packed_logits(model, packed.ids, packed.position_ids)[b, : len(r["input_ids"])]
            for b, r in enumerate(rows)
        ]
    )
    # (transformers builds its rotary tables in float32: equal to that rounding)
    torch.testing.assert_close(hf_logits, real, rtol=0, atol=1e-6)
