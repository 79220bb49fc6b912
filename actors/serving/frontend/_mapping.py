"""From a validated OpenAI request to the engine's :class:`PreprocessedRequest` of each choice.

Tokenisation (chat template or prompts), context-length checks, and the field mapping:
``max_tokens``/``max_completion_tokens``, ``min_tokens``, ``stop``, sampling options,
``logit_bias``, ``response_format``/``regex``/``ebnf`` as guided decoding; then one engine request
per choice (:func:`choice_requests`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from functools import partial

import anyio
import msgspec

from protocols.engine import Grammar, PreprocessedRequest, SamplingOptions, StopConditions
from protocols.errors import ContextLengthExceeded

from ._backend import ModelInfo
from ._errors import invalid
from ._openai_types import ChatCompletionRequest, CompletionRequest
from ._parsers._chat import NO_TOOLS, ToolPlan, template_messages

__all__ = [
    "build_request",
    "chat_prompt",
    "choice_requests",
    "completion_prompts",
    "guided_decoding",
    "logit_bias",
    "tokenize",
]

#: Prompts longer than this (in characters) are tokenised in a worker thread, so one huge prompt
#: cannot stall every other stream on the event loop; short ones stay inline (a thread hop costs
#: more than tokenising them).
_THREAD_TOKENIZE_CHARS = 32_768


async def tokenize(
    fn: Callable[[], list[int]], size: int, info: ModelInfo, param: str
) -> list[int]:
    """``fn()``, the token ids of a text of ``size`` characters, for the request's ``param``:
    refused unrun when the text must be longer than the context, in a thread when large."""
    # A text can encode to no fewer tokens than this: past the context, refuse it before the
    # tokenizer builds a list of ids as long as the text (a large prompt would pin memory).
    at_least = -(-size // info.tokenizer.max_token_chars)
    if at_least >= info.context_length:
        raise context_exceeded(info.context_length, at_least, param, None, at_least=True)
    if size > _THREAD_TOKENIZE_CHARS:
        return await anyio.to_thread.run_sync(fn)
    return fn()


async def chat_prompt(
    info: ModelInfo, body: ChatCompletionRequest, tools: ToolPlan = NO_TOOLS
) -> list[int]:
    """The conversation through the model's chat template, ending with the generation prompt;
    with the request's tools, calls and tool results (see ``_parsers._chat``)."""
    tokenizer = info.tokenizer
    messages, tool_specs = template_messages(body.messages, tools, native=tokenizer.renders_tools)
    size = sum(len(m["content"]) for m in messages)
    return await tokenize(
        lambda: tokenizer.apply_chat_template(messages, tools=tool_specs), size, info, "messages"
    )


async def completion_prompts(
    info: ModelInfo, body: CompletionRequest
) -> list[tuple[str, list[int]]]:
    """Each prompt's text (for ``echo``) and token ids, in the batch's order."""
    prompts: list[tuple[str, list[int]]] = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            ids = await tokenize(
                partial(info.tokenizer.encode, prompt), len(prompt), info, "prompt"
            )
            prompts.append((prompt, ids))
        else:
            prompts.append((info.tokenizer.decode(prompt) if body.echo else "", list(prompt)))
    return prompts


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


def guided_decoding(body: ChatCompletionRequest | CompletionRequest) -> Grammar | None:
    """``response_format``, ``regex`` or ``ebnf`` (the model allows one) as the engine's
    grammar."""
    if body.regex is not None:
        return Grammar(kind="regex", spec=body.regex)
    if body.ebnf is not None:
        return Grammar(kind="ebnf", spec=body.ebnf)
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return Grammar(kind="json_object")
    return Grammar(kind="json_schema", spec=json.dumps(fmt.json_schema.schema_))


def logit_bias(
    body: ChatCompletionRequest | CompletionRequest, info: ModelInfo
) -> dict[int, float] | None:
    """``logit_bias`` with token ids as numbers; an id outside the model's vocabulary (where
    it is known) is refused."""
    if not body.logit_bias:
        return None
    bias = {int(token): value for token, value in body.logit_bias.items()}
    vocab = info.vocab_size
    if vocab is not None and max(bias) >= vocab:
        raise invalid(
            f"token id {max(bias)} is outside the model's vocabulary ({vocab} tokens)",
            "logit_bias",
        )
    return bias


def build_request(
    rid: str,
    prompt: list[int],
    info: ModelInfo,
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    param: str,
    guided: Grammar | None,
    logprobs: int | None = None,
    *,
    bias: dict[int, float] | None = None,
    prompt_logprobs: int | None = None,
) -> PreprocessedRequest:
    """The engine request; raises 400s for empty prompts and context overflows.

    ``max_tokens=None`` means the rest of the context. ``param`` names the prompt's field
    (``messages`` or ``prompt``) in errors. ``logprobs``: how many alternatives per token the
    client wants with each token's logprob (``None``: no logprobs); ``prompt_logprobs`` the same
    for the prompt's tokens.
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
            logit_bias=bias,
            guided_decoding=guided,
        ),
        eos_token_ids=info.tokenizer.eos_token_ids,
        model=info.name,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


#: Spreads the seeds of a request's choices over the seed space (the golden ratio's odd 64-bit
#: multiplier, as splitmix64 steps its state).
_SEED_STEP = 0x9E3779B97F4A7C15


def choice_requests(request: PreprocessedRequest, indexes: range) -> list[PreprocessedRequest]:
    """The engine requests of the choices ``indexes`` over ``request``'s prompt: each its own
    request ``<rid>-<index>``, which the engine's prefix cache lets share the prompt's KV.

    A seed gives each choice a seed of its own, derived from it and the index, so the choices
    differ and a rerun repeats them all; unseeded choices get a random seed of the request, so
    that they differ on engines whose unseeded sampling is deterministic (the mock's).
    """
    seed = request.sampling_options.seed
    if seed is None:
        seed = secrets.randbits(63)
    return [
        msgspec.structs.replace(
            request,
            rid=f"{request.rid}-{index}",
            sampling_options=msgspec.structs.replace(
                request.sampling_options, seed=(seed + index * _SEED_STEP) % 2**64
            ),
        )
        for index in indexes
    ]
