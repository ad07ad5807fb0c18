"""Counting prompt tokens where the backend has no tokenizer of its own.

The vLLM backend counts with its engine's tokenizer. The openai backend cannot
reach its upstream's, so it counts with a tokenizer file the policy names
(`backend.tokenizer`, a Hugging Face `tokenizer.json`), and failing that with
the estimate below, as the sim backend does. Quotas reserve what is counted
here, so a closer count means less held back and less charged on settlement.
"""

from __future__ import annotations

import json
from typing import Any

CHARS_PER_TOKEN = 4
"""About four characters per token for English text with BPE tokenizers."""
TOKENS_PER_MESSAGE = 4
"""What a chat template adds around each message (role markers, separators)."""


def _texts(endpoint: str, body: dict[str, Any]) -> tuple[list[str], int]:
    """The prompt's texts, and the tokens a chat template adds around them."""
    texts: list[str] = []
    framing = 0

    def add(content: Any) -> None:
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    texts.append(part["text"])

    if endpoint == "chat":
        messages = body.get("messages")
        if isinstance(messages, list):
            for message in messages:
                if isinstance(message, dict):
                    framing += TOKENS_PER_MESSAGE
                    add(message.get("content"))
        tools = body.get("tools")
        if tools:
            texts.append(json.dumps(tools, separators=(",", ":")))
    else:
        add(body.get("prompt"))
    return texts, framing


class TokenizerCounter:
    """Counts with a Hugging Face tokenizer file (the `tokenizers` package:
    `pip install 'qosgate[tokenizer]'`). The chat template's framing is the
    same per-message allowance the estimate uses."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerUnavailable(
                "backend.tokenizer: the `tokenizers` package is not installed "
                "(pip install 'qosgate[tokenizer]')"
            ) from exc
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as exc:
            raise TokenizerUnavailable(
                f"backend.tokenizer: cannot load {path!r} as a tokenizer.json: {exc}"
            ) from exc

    def __call__(self, endpoint: str, body: dict[str, Any]) -> int:
        ids = prompt_token_ids(body) if endpoint == "completions" else None
        if ids is not None:
            return max(1, len(ids))
        texts, framing = _texts(endpoint, body)
        if texts:
            encoded = self._tokenizer.encode_batch(texts, add_special_tokens=False)
            framing += sum(len(e.ids) for e in encoded)
        return max(1, framing)


class TokenizerUnavailable(ValueError):
    """The tokenizer the policy names cannot be used."""


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids (`[ids]` or `[[ids]]`), as
    validated; None for a text prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        return prompt[0] if isinstance(prompt[0], list) else prompt
    return None


def estimate_prompt_tokens(endpoint: str, body: dict[str, Any]) -> int:
    """ceil(characters / 4) over the message contents (chat, plus the template's
    framing per message and any tool schemas) or the prompt (completions); at
    least 1. A prompt of token ids counts its ids."""
    ids = prompt_token_ids(body) if endpoint == "completions" else None
    if ids is not None:
        return max(1, len(ids))
    texts, framing = _texts(endpoint, body)
    chars = sum(len(text) for text in texts)
    return max(1, -(-chars // CHARS_PER_TOKEN) + framing)
