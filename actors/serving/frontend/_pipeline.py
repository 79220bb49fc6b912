"""From engine outputs to client text: detokenisation, stop strings, finish reason, usage.

Pure logic, no I/O: the HTTP layer feeds :class:`Choice` each :class:`EngineOutput` and sends what
comes out. Stop strings are matched in the detokenised text (the engine sees token ids only):
text that could still be the start of a stop string is held back ("jailed", in Dynamo's words)
until it is known not to be; on a match the text is cut before the stop string, which is never
sent, and the request finishes with ``stop``.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocols.engine import EngineOutput, Usage
from protocols.engine import TokenLogprob as EngineLogprob
from protocols.errors import EngineFailure, RequestCancelled

from ._chunks import TokenLogprob, TopLogprob
from ._tokenizer import Detokenizer, Tokenizer

__all__ = ["Choice", "StopMatcher"]

#: What a token outside the distribution it was drawn from is reported with: JSON has no -inf
#: (OpenAI and vLLM say the same).
_LOGPROB_FLOOR = -9999.0


class StopMatcher:
    """Finds stop strings across output boundaries, holding back possible prefixes.

    Each stop string keeps a Knuth-Morris-Pratt state (how much of it the text so far ends
    with), so every character is looked at a bounded number of times per stop string: the work
    is linear in the output, whatever the stop strings' lengths. The text held back is the
    longest tail that may still become a stop string.
    """

    __slots__ = ("_fail", "_held", "_states", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._fail = [_prefix_function(s) for s in self._stops]
        self._states = [0] * len(self._stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """New text in; the text now safe to send out, and whether a stop string was found."""
        if not self._stops:
            return text, False
        offset = len(self._held)
        cut = -1
        states = self._states
        for j, stop in enumerate(self._stops):
            q = states[j]
            if q == 0 and stop[0] not in text:
                continue  # the usual case: nothing of this stop string anywhere near
            fail, n = self._fail[j], len(stop)
            for i, ch in enumerate(text):
                while q and stop[q] != ch:
                    q = fail[q - 1]
                if stop[q] == ch:
                    q += 1
                    if q == n:
                        start = offset + i + 1 - n
                        if cut == -1 or start < cut:
                            cut = start
                        break
            states[j] = q
        buf = self._held + text
        if cut != -1:
            self._held = ""
            self._states = [0] * len(self._stops)
            return buf[:cut], True
        keep = max(states)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def release(self) -> str:
        """The stream ended without a match: what was held back goes out after all."""
        held, self._held = self._held, ""
        return held


def _prefix_function(pattern: str) -> list[int]:
    """KMP's failure table: for each prefix, the length of its longest proper border."""
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table


class Choice:
    """The state of one generated choice.

    :meth:`on_output` returns the text to send for an output and the finish reason once the
    choice is complete (``stop`` or ``length``). It raises :class:`~protocols.errors.RequestError`
    for an output that ends the request badly (an engine error, a server-side abort).

    With ``logprobs`` (the model's tokenizer, when the request asked for logprobs) it also
    collects each token's logprob, which :meth:`take_logprobs` hands out for the next frame sent:
    where the detokeniser or a stop string holds text back, a token's text and its logprob may
    go out in different frames. With ``echo`` (the prompt's token ids) too, the prompt's tokens
    and logprobs, from the first output, come first.

    ``ranked`` sums the logprobs of the generated tokens in ``logprob_sum`` (``best_of`` picks
    the choices of the highest), which the engine must then send.
    """

    __slots__ = (
        "_detok",
        "_echo",
        "_logprobs",
        "_min_tokens",
        "_pending",
        "_ranked",
        "_stop",
        "_stops",
        "completion_tokens",
        "logprob_sum",
        "prompt_tokens",
        "usage",
    )

    def __init__(
        self,
        detokenizer: Detokenizer,
        *,
        prompt_tokens: int,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        logprobs: Tokenizer | None = None,
        echo: Sequence[int] | None = None,
        ranked: bool = False,
    ) -> None:
        self._detok = detokenizer
        self._logprobs = logprobs
        self._echo = echo if logprobs is not None else None
        self._ranked = ranked
        self.logprob_sum = 0.0
        self._pending: list[TokenLogprob] = []
        self._stop = StopMatcher(stop)
        self._stops = any(stop)  # else feeding the matcher is a no-op: skipped per output
        self._min_tokens = min_tokens
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.usage: Usage | None = None

    def on_output(self, out: EngineOutput) -> tuple[str, str | None]:
        """Text to send for ``out`` and the finish reason if the choice is now complete."""
        text = ""
        if self._echo is not None:
            self._echo_prompt(out.prompt_logprobs)
        if out.token_ids:
            self.completion_tokens += len(out.token_ids)
            if out.logprobs is not None:
                self._on_logprobs(out.token_ids, out.logprobs)
            text = self._detok.step(out.token_ids)
            # Like vLLM, stop strings count only once min_tokens were generated.
            if self._stops and self.completion_tokens >= self._min_tokens:
                text, stopped = self._stop.feed(text)
                if stopped:
                    return text, "stop"
        if out.usage is not None:
            self.usage = out.usage
        reason = out.finish_reason
        if reason is None:
            return text, None
        if reason == "error":
            raise EngineFailure(out.error or "the engine failed the request")
        if reason == "cancelled":
            # The client did not cancel (it is still reading): the server aborted the request.
            raise RequestCancelled("the request was aborted by the server")
        tail, stopped = self._stop.feed(self._detok.flush())
        text += tail
        if stopped:
            return text, "stop"
        return text + self._stop.release(), reason

    @property
    def wants_logprobs(self) -> bool:
        return self._logprobs is not None

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs collected since the last call (``None`` if the request wants none)."""
        if self._logprobs is None:
            return None
        taken, self._pending = self._pending, []
        return taken

    def _on_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[EngineLogprob]) -> None:
        if self._ranked:
            self.logprob_sum += sum(entry.logprob for entry in logprobs)
        tokenizer = self._logprobs
        if tokenizer is None:
            return  # asked of the engine for ranking only
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            token, data = _token(tokenizer, token_id)
            self._pending.append(_entry(tokenizer, token, data, entry))

    def _echo_prompt(self, logprobs: Sequence[EngineLogprob] | None) -> None:
        """The echoed prompt's tokens and logprobs (the first has none), before any other."""
        prompt, tokenizer = self._echo, self._logprobs
        assert prompt is not None and tokenizer is not None
        self._echo = None
        logprobs = logprobs or ()
        if len(logprobs) != len(prompt) - 1:
            raise EngineFailure("the engine sent no logprobs of the prompt's tokens")
        for i, token_id in enumerate(prompt):
            token, data = _token(tokenizer, token_id)
            if _special(tokenizer, token_id, data):
                data = []  # takes no room in the echoed text (see TokenLogprob)
            if i == 0:
                self._pending.append(TokenLogprob(token, None, data, []))
            else:
                self._pending.append(_entry(tokenizer, token, data, logprobs[i - 1]))

    def final_usage(self) -> Usage:
        """The engine's usage when it sent one, else the frontend's own count."""
        if self.usage is not None and self.usage.completion_tokens >= self.completion_tokens:
            return self.usage
        cached = None if self.usage is None else self.usage.cached_tokens
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=cached,
        )


def _entry(tokenizer: Tokenizer, token: str, data: list[int], entry: EngineLogprob) -> TokenLogprob:
    """A token's logprob and its alternatives, as the client sees them."""
    top: list[TopLogprob] = []
    for alt, logprob in zip(entry.top_ids, entry.top_logprobs, strict=False):
        alt_token, alt_bytes = _token(tokenizer, alt)
        top.append(TopLogprob(alt_token, max(logprob, _LOGPROB_FLOOR), alt_bytes))
    return TokenLogprob(token, max(entry.logprob, _LOGPROB_FLOOR), data, top)


def _special(tokenizer: Tokenizer, token_id: int, data: list[int]) -> bool:
    """Whether a prompt token is a special one (BOS and friends), which decoding skips: whole
    characters on its own, yet no text."""
    try:
        bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return False  # part of a character, which decodes to text with its neighbours
    return bool(data) and not tokenizer.decode([token_id])


def _token(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes; bytes that are not whole characters on their own are
    written as escapes (``\\xe2``), so no two tokens read the same."""
    data = tokenizer.token_bytes(token_id)
    return data.decode("utf-8", "backslashreplace"), list(data)
