"""From a validated OpenAI request to the engine's :class:`PreprocessedRequest`.

Tokenisation (chat template or prompt), context-length checks, and the field mapping:
``max_tokens``/``max_completion_tokens``, ``min_tokens``, ``stop``, sampling options,
``response_format`` as guided decoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import anyio

from protocols.engine import Grammar, PreprocessedRequest, SamplingOptions, StopConditions
from protocols.errors import ContextLengthExceeded

from ._backend import ModelInfo
from ._errors import invalid
from ._openai_types import ChatCompletionRequest, CompletionRequest, ResponseFormat

__all__ = ["build_request", "chat_prompt", "completion_prompt", "guided_decoding"]

#: Prompts longer than this (in characters) are tokenised in a worker thread, so one huge prompt
#: cannot stall every other stream on the event loop; short ones stay inline (a thread hop costs
#: more than tokenising them).
_THREAD_TOKENIZE_CHARS = 32_768


async def _tokenize(
    fn: Callable[[], list[int]], size: int, info: ModelInfo, param: str
) -> list[int]:
    # A text can encode to no fewer tokens than this: past the context, refuse it before the
    # tokenizer builds a list of ids as long as the text (a large prompt would pin memory).
    at_least = -(-size // info.tokenizer.max_token_chars)
    if at_least >= info.context_length:
        raise context_exceeded(info.context_length, at_least, param, None, at_least=True)
    if size > _THREAD_TOKENIZE_CHARS:
        return await anyio.to_thread.run_sync(fn)
    return fn()


async def chat_prompt(info: ModelInfo, body: ChatCompletionRequest) -> list[int]:
    """The conversation through the model's chat template, ending with the generation prompt."""
    messages: list[dict[str, str]] = []
    for msg in body.messages:
        entry = {"role": msg.role, "content": msg.text()}
        if msg.name:
            entry["name"] = msg.name
        messages.append(entry)
    size = sum(len(m["content"]) for m in messages)
    return await _tokenize(
        lambda: info.tokenizer.apply_chat_template(messages), size, info, "messages"
    )


async def completion_prompt(info: ModelInfo, body: CompletionRequest) -> tuple[str, list[int]]:
    """The prompt's text (for ``echo``) and token ids; one prompt, as text or as ids (or a list
    of one of those: the model allows no more)."""
    prompt = body.prompt
    if isinstance(prompt, list) and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
        return text, await _tokenize(lambda: info.tokenizer.encode(text), len(text), info, "prompt")
    ids = [int(t) for t in prompt]
    return (info.tokenizer.decode(ids) if body.echo else ""), ids


def context_exceeded(
    ctx: int, n_prompt: int, param: str, max_tokens: int | None, *, at_least: bool = False
) -> ContextLengthExceeded:
    """OpenAI's 400 for a request longer than the context (``at_least``: counted from the
    text's length before tokenising it)."""
    wanted = "" if max_tokens is None else f" plus {max_tokens} in the completion"
    many = f"at least {n_prompt}" if at_least else f"{n_prompt}"
    exc = ContextLengthExceeded(
        f"This model's maximum context length is {ctx} tokens. However, you requested "
        f"{many} tokens in the {param}{wanted}. Please reduce the length of the "
        f"{param} or completion."
    )
    setattr(exc, "param", param)  # noqa: B010
    return exc


def guided_decoding(fmt: ResponseFormat | None) -> Grammar | None:
    """``response_format`` as the engine's grammar."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return Grammar(kind="json_object")
    return Grammar(kind="json_schema", spec=json.dumps(fmt.json_schema.schema_))


def build_request(
    rid: str,
    prompt: list[int],
    info: ModelInfo,
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    param: str,
    guided: Grammar | None,
    logprobs: int | None = None,
) -> PreprocessedRequest:
    """The engine request; raises 400s for empty prompts and context overflows.

    ``max_tokens=None`` means the rest of the context. ``param`` names the prompt's field
    (``messages`` or ``prompt``) in errors. ``logprobs``: how many alternatives per token the
    client wants with each token's logprob (``None``: no logprobs).
    """
    n_prompt, ctx = len(prompt), info.context_length
    if n_prompt == 0:
        raise invalid("the prompt is empty", param)
    if n_prompt >= ctx or (max_tokens is not None and n_prompt + max_tokens > ctx):
        raise context_exceeded(ctx, n_prompt, param, max_tokens)
    if max_tokens is None:
        max_tokens = ctx - n_prompt
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        message = f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})"
        raise invalid(message, "min_tokens")
    stop: Sequence[str] | None = [body.stop] if isinstance(body.stop, str) else body.stop
    return PreprocessedRequest(
        rid=rid,
        token_ids=prompt,
        stop_conditions=StopConditions(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=list(stop) if stop else None,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
        ),
        sampling_options=SamplingOptions(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            guided_decoding=guided,
        ),
        eos_token_ids=info.tokenizer.eos_token_ids,
        model=info.name,
        logprobs=logprobs,
    )
