"""Chapter 26: a chat format — the special tokens that mark who speaks, and a template that
turns a conversation into token ids and says which of them are the assistant's.

A conversation is a list of messages ``{"role": ..., "content": ...}`` with the roles
:data:`ROLES`. :func:`apply_chat_template` renders it as

    ``<bos><|user|>Translate to English: Ein Hund.<|end|><|assistant|>A dog.<|end|>``

— each message opens with its role's token and closes with ``<|end|>``, the token the model
learns to emit when its answer is complete (generation stops there). It returns the ids and the
*assistant mask*: True on the tokens the assistant wrote, its content and its ``<|end|>``, the
only tokens the fine-tuning loss scores (:mod:`~transformer_tutorial.tuning.sft`). This is what
``transformers``' ``tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)``
returns for :data:`CHAT_TEMPLATE`, the same format written in Jinja with ``{% generation %}``
around the assistant's tokens (proven equal in ``tests/test_tuning_chat.py``).

Shapes: ids and masks are lists of one conversation's ``T`` tokens; a batch is made by
:func:`~transformer_tutorial.tuning.sft.pad_examples` or packed by
:func:`~transformer_tutorial.tuning.sft.pack_examples`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer

from transformer_tutorial.checks import check_bool, check_type
from transformer_tutorial.data import BOS, BOS_ID

ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}
END = "<|end|>"
CHAT_TOKENS = (*ROLE_TOKENS.values(), END)  # added to the tokenizer, in this order

# The same format for transformers' apply_chat_template; {% generation %} marks the tokens
# return_assistant_tokens_mask reports (TRL's assistant_only_loss reads them).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class ChatTokens:
    """The ids of the chat format's special tokens in one tokenizer."""

    bos: int
    system: int
    user: int
    assistant: int
    end: int

    def role(self, role: str) -> int:
        """The id of the token that opens a message of ``role``."""
        return getattr(self, role)


@dataclass(frozen=True)
class ChatEncoding:
    """One conversation as tokens: ``ids`` and ``assistant_mask`` (True on the assistant's
    tokens: what the loss scores), both of length ``T``."""

    ids: list[int]
    assistant_mask: list[bool]


def add_chat_tokens(tokenizer: Tokenizer) -> ChatTokens:
    """Add :data:`CHAT_TOKENS` to ``tokenizer`` as special tokens (never split, never merged
    with text; ids after the vocabulary it had) and return their ids. Adding them again changes
    nothing. The model's ``vocab_size`` must then be ``tokenizer.get_vocab_size()``."""
    check_type("tokenizer", tokenizer, Tokenizer, "a tokenizers.Tokenizer")
    if tokenizer.token_to_id(BOS) != BOS_ID:
        raise ValueError(f"tokenizer must map {BOS} to {BOS_ID} (data.train_tokenizer does)")
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in CHAT_TOKENS])
    ids = {role: tokenizer.token_to_id(token) for role, token in ROLE_TOKENS.items()}
    return ChatTokens(bos=BOS_ID, end=tokenizer.token_to_id(END), **ids)


def chat_tokens(tokenizer: Tokenizer) -> ChatTokens:
    """The ids of the chat tokens already in ``tokenizer`` (:func:`add_chat_tokens`)."""
    check_type("tokenizer", tokenizer, Tokenizer, "a tokenizers.Tokenizer")
    missing = [t for t in CHAT_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer lacks the chat tokens {missing}: call add_chat_tokens first")
    ids = {role: tokenizer.token_to_id(token) for role, token in ROLE_TOKENS.items()}
    return ChatTokens(bos=BOS_ID, end=tokenizer.token_to_id(END), **ids)


def check_messages(messages: object) -> None:
    """``messages`` must be a non-empty list of ``{"role", "content"}`` with a known role and a
    string content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of messages, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            raise ValueError(
                f"messages[{i}] must be a dict with the keys 'role' and 'content', got {message!r}"
            )
        if message["role"] not in ROLES:
            raise ValueError(
                f"messages[{i}]['role'] must be one of {list(ROLES)}, got {message['role']!r}"
            )
        if not isinstance(message["content"], str):
            raise ValueError(f"messages[{i}]['content'] must be a str, got {message['content']!r}")


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = False,
) -> ChatEncoding:
    """The ids of ``messages`` in the chat format, and which of them are the assistant's.

    ``<bos>``, then for each message its role's token, its content's ids and ``<|end|>``; the
    assistant mask is True on an assistant message's content and its ``<|end|>`` (not on the
    role token: the prompt chose it). ``add_generation_prompt`` ends with ``<|assistant|>``,
    the prompt from which a model writes its answer (and stops at ``<|end|>``)."""
    check_messages(messages)
    check_bool("add_generation_prompt", add_generation_prompt)
    tokens = chat_tokens(tokenizer)
    ids, mask = [tokens.bos], [False]
    for message in messages:
        content = tokenizer.encode(message["content"], add_special_tokens=False).ids
        ids += [tokens.role(message["role"]), *content, tokens.end]
        mask += [False] + [message["role"] == "assistant"] * (len(content) + 1)
    if add_generation_prompt:
        ids.append(tokens.assistant)
        mask.append(False)
    return ChatEncoding(ids, mask)


def translation_chat(german: str, english: str | None = None) -> list[dict[str, str]]:
    """One Multi30k pair as a conversation: the user asks ``"Translate to English: <german>"``,
    the assistant answers ``english`` (left out when None: a prompt to answer)."""
    check_type("german", german, str, "a str")
    messages = [{"role": "user", "content": f"Translate to English: {german}"}]
    if english is not None:
        check_type("english", english, str, "a str")
        messages.append({"role": "assistant", "content": english})
    return messages
