"""Reasoning parsers (``--reasoning-parser``, SGLang's names): ``<think>...</think>`` reasoning
split from the answer, incrementally.

- ``deepseek-r1``: the output starts inside the reasoning (the chat template opened ``<think>``
  in the prompt; an opening tag in the output is skipped too); everything up to ``</think>`` is
  reasoning, and an output without ``</think>`` is all reasoning.
- ``qwen3``: reasoning only when the output starts with ``<think>``; otherwise all content.
- ``qwen3-thinking``: Qwen3's thinking-only models, whose template opens ``<think>``: as
  ``deepseek-r1``.
- ``step3`` reads as ``deepseek-r1``, ``minimax`` as ``qwen3`` (as in SGLang).

Whitespace right after ``<think>`` and right after ``</think>`` is dropped, as SGLang does.
"""

from __future__ import annotations

from ._scan import held_prefix

__all__ = ["REASONING_PARSERS", "ReasoningParser"]

START = "<think>"
END = "</think>"
_OPENING, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    """Splits one choice's text into reasoning and content: ``feed`` returns the two parts of
    the text now decided; tags split across feeds are held back until known."""

    __slots__ = ("_buf", "_force", "_state", "_strip")

    def __init__(self, *, force: bool) -> None:
        self._force = force
        self._state = _OPENING
        self._buf = ""
        self._strip = True  # drop leading whitespace of the part being read

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content of the text decided so far."""
        if self._state == _CONTENT and not self._strip:
            return "", text  # the usual case once reasoning is over
        self._buf += text
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    def _step(self, *, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == _OPENING:
                rest = self._buf.lstrip()
                if rest.startswith(START):
                    self._buf = rest[len(START) :]
                    self._state = _REASONING
                    continue
                if not final and (not rest or START.startswith(rest)):
                    break
                self._state = _REASONING if self._force else _CONTENT
                self._strip = self._force
                continue
            if self._strip:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._strip = False
            if self._state == _CONTENT:
                content.append(self._buf)
                self._buf = ""
                break
            at = self._buf.find(END)
            if at != -1:
                reasoning.append(self._buf[:at])
                self._buf = self._buf[at + len(END) :]
                self._state = _CONTENT
                self._strip = True
                continue
            held = 0 if final else held_prefix(self._buf, (END,))
            reasoning.append(self._buf[: len(self._buf) - held])
            self._buf = self._buf[len(self._buf) - held :]
            break
        return "".join(reasoning), "".join(content)


#: ``--reasoning-parser`` names, and whether the output starts inside the reasoning.
REASONING_PARSERS: dict[str, bool] = {
    "deepseek-r1": True,
    "step3": True,  # (SGLang reads Step-3's as DeepSeek-R1's)
    "qwen3": False,
    "qwen3-thinking": True,
    "minimax": False,  # (and MiniMax's as Qwen3's)
}
