"""Prompt-token estimate for backends without a tokenizer at hand.

The sim and openai backends cannot count with the model's tokenizer (the
upstream's is not reachable over the OpenAI API); the vLLM backend counts
exactly. One estimate for both keeps admission and batch-token decisions from
depending on which backend a policy names.
"""

from __future__ import annotations

import json
from typing import Any

CHARS_PER_TOKEN = 4
"""About four characters per token for English text with BPE tokenizers."""
TOKENS_PER_MESSAGE = 4
"""What a chat template adds around each message (role markers, separators)."""


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    return 0


def estimate_prompt_tokens(endpoint: str, body: dict[str, Any]) -> int:
    """ceil(characters / 4) over the message contents (chat, plus the template's
    framing per message and any tool schemas) or the prompt (completions); at
    least 1."""
    chars = 0
    framing = 0
    if endpoint == "chat":
        messages = body.get("messages")
        if isinstance(messages, list):
            for message in messages:
                if isinstance(message, dict):
                    framing += TOKENS_PER_MESSAGE
                    chars += _text_chars(message.get("content"))
        tools = body.get("tools")
        if tools:
            # Tool schemas are rendered into the prompt by the template.
            chars += len(json.dumps(tools, separators=(",", ":")))
    else:
        chars += _text_chars(body.get("prompt"))
    return max(1, -(-chars // CHARS_PER_TOKEN) + framing)
