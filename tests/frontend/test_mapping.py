"""From a validated request to the engine's: a prompt that cannot fit the context is refused
before the tokenizer sees it (a huge prompt would otherwise be tokenised whole first)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from actors.serving.frontend import ByteTokenizer, ModelInfo
from actors.serving.frontend._mapping import chat_prompt, completion_prompts
from actors.serving.frontend._openai_types import ChatCompletionRequest, CompletionRequest
from protocols.errors import ContextLengthExceeded


class _Counting(ByteTokenizer):
    """Counts the calls that tokenise."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return super().encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        self.calls += 1
        return super().apply_chat_template(messages, tools)


def _info(tokenizer: _Counting) -> ModelInfo:
    return ModelInfo(name="m", context_length=1000, tokenizer=tokenizer)


async def test_a_prompt_longer_than_the_context_is_refused_untokenised() -> None:
    tokenizer = _Counting()
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x" * 5_000_000})
    with pytest.raises(ContextLengthExceeded, match="at least 5000000 tokens in the prompt"):
        await completion_prompts(_info(tokenizer), body)
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "y" * 1000}]}
    )
    with pytest.raises(ContextLengthExceeded, match="in the messages"):
        await chat_prompt(_info(tokenizer), chat)
    assert tokenizer.calls == 0


async def test_a_prompt_that_may_fit_is_tokenised() -> None:
    tokenizer = _Counting()
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x" * 998})
    [(text, ids)] = await completion_prompts(_info(tokenizer), body)
    assert (len(text), len(ids), tokenizer.calls) == (998, 999, 1)  # BOS + one id per byte
