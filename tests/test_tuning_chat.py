"""Chapter 26's chat format: special tokens, the template, the assistant mask — equal to
transformers' apply_chat_template with return_assistant_tokens_mask."""

import copy

import pytest
from tokenizers import Tokenizer

from transformer_tutorial import data
from transformer_tutorial.tuning.chat import (
    CHAT_TEMPLATE,
    CHAT_TOKENS,
    END,
    ChatEncoding,
    add_chat_tokens,
    apply_chat_template,
    chat_tokens,
    translation_chat,
)

SENTENCES = ["Ein Hund läuft.", "A dog runs.", "Zwei Männer spielen Fußball.", "Two men play."] * 5


@pytest.fixture
def tokenizer() -> Tokenizer:
    tokenizer = data.train_tokenizer(SENTENCES, vocab_size=100)
    add_chat_tokens(tokenizer)
    return tokenizer


CONVERSATIONS = [
    translation_chat("Ein Hund läuft.", "A dog runs."),
    [
        {"role": "system", "content": "Answer in English."},
        *translation_chat("Zwei Männer.", "Two men."),
        {"role": "user", "content": "Und der Hund?"},
        {"role": "assistant", "content": "The dog runs."},
    ],
    [{"role": "user", "content": "Hund"}, {"role": "assistant", "content": ""}],
]


def test_chat_tokens_are_added_once_after_the_vocabulary():
    tokenizer = data.train_tokenizer(SENTENCES, vocab_size=100)
    size = tokenizer.get_vocab_size()
    tokens = add_chat_tokens(tokenizer)
    assert [tokens.system, tokens.user, tokens.assistant, tokens.end] == list(
        range(size, size + 4)
    )
    assert add_chat_tokens(tokenizer) == tokens == chat_tokens(tokenizer)
    assert tokenizer.get_vocab_size() == size + len(CHAT_TOKENS)
    # never split: the token in text is the one id
    assert tokenizer.encode(f"dog{END}", add_special_tokens=False).ids[-1] == tokens.end


def test_template_by_hand(tokenizer):
    t = chat_tokens(tokenizer)
    encoding = apply_chat_template(tokenizer, CONVERSATIONS[0])
    question = tokenizer.encode("Translate to English: Ein Hund läuft.").ids
    answer = tokenizer.encode("A dog runs.").ids
    assert encoding.ids == [t.bos, t.user, *question, t.end, t.assistant, *answer, t.end]
    n = 4 + len(question)  # <bos> <|user|> question <|end|> <|assistant|>
    assert encoding.assistant_mask == [False] * n + [True] * (len(answer) + 1)
    prompt = apply_chat_template(tokenizer, CONVERSATIONS[0][:1], add_generation_prompt=True)
    assert prompt.ids == encoding.ids[:n] and not any(prompt.assistant_mask)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_equal_to_transformers_apply_chat_template(tokenizer, conversation):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(tokenizer), bos_token="<bos>", pad_token="<pad>"
    )
    theirs = hf.apply_chat_template(
        conversation,
        chat_template=CHAT_TEMPLATE,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ours = apply_chat_template(tokenizer, conversation)
    assert ours.ids == theirs["input_ids"]
    assert ours.assistant_mask == [bool(m) for m in theirs["assistant_masks"]]
    prompt = conversation[:-1]
    theirs = hf.apply_chat_template(
        prompt,
        chat_template=CHAT_TEMPLATE,
        tokenize=True,
        return_dict=True,
        add_generation_prompt=True,
    )["input_ids"]
    assert apply_chat_template(tokenizer, prompt, add_generation_prompt=True).ids == theirs


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "bot", "content": "hi"}], r"messages\[0\]\['role'\] must be one of"),
        ([{"role": "user"}], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a str"),
    ],
)
def test_bad_messages_are_refused_by_name(tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        apply_chat_template(tokenizer, messages)


def test_tokenizer_without_chat_tokens_is_refused():
    tokenizer = data.train_tokenizer(SENTENCES, vocab_size=100)
    with pytest.raises(ValueError, match="add_chat_tokens"):
        apply_chat_template(tokenizer, CONVERSATIONS[0])
    with pytest.raises(TypeError, match="tokenizer must be"):
        add_chat_tokens("tokenizer")


def test_encoding_is_a_frozen_record(tokenizer):
    encoding = apply_chat_template(tokenizer, CONVERSATIONS[0])
    assert isinstance(encoding, ChatEncoding) and len(encoding.ids) == len(encoding.assistant_mask)
    with pytest.raises(AttributeError):
        encoding.ids = []
