"""Incremental scanning of one tool call's JSON object, and the hold-back rule for markers.

:class:`CallScanner` reads ``{"name": ..., "arguments": {...}}`` as its text arrives: it learns the
name as soon as its string is complete and hands out the arguments' raw text as it comes, so the
arguments stream without waiting for the call's end. It checks the structure as it goes (an
unexpected key, a name that is no string, arguments that are no object fail at once) and the
whole object with :func:`json.loads` at its end, so a call it accepts is valid JSON.

No partial-JSON library (SGLang uses ``partial-json-parser``): those re-parse the whole prefix
on every delta and give values, not text; streaming the arguments' own text needs only where
values begin and end, which one pass over each character finds.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable

__all__ = ["CallScanner", "held_prefix"]

_WS = " \t\r\n"

# Scanner states.
_BEFORE, _KEY, _IN_KEY, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE = range(7)


def held_prefix(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of ``text`` that is the start of a marker (not a whole
    one): that text may still become the marker, so it is held back."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class CallScanner:
    """One call object, fed text until :attr:`done` or :attr:`failed`.

    ``feed`` consumes text up to the object's closing brace (or up to the character that broke
    it) and returns how much it consumed. ``take`` hands out what is ready to stream: the name
    once known and the arguments' text since the last call, never arguments before the name.
    """

    __slots__ = (
        "_args",
        "_args_keys",
        "_depth",
        "_esc",
        "_first_key",
        "_in_str",
        "_key",
        "_keys",
        "_names",
        "_state",
        "_value",
        "_value_kind",
        "announced",
        "arguments",
        "done",
        "failed",
        "name",
        "raw",
    )

    def __init__(self, args_keys: Collection[str], names: Collection[str] | None = None) -> None:
        self._args_keys = args_keys
        self._names = names
        self._keys = {"name", "type", *args_keys}
        self._state = _BEFORE
        self._first_key = True
        self._key: list[str] = []
        self._value: list[str] = []  # the current value's text
        self._value_kind = ""  # its first character
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._args: list[str] = []  # arguments text not handed out yet
        self.raw: list[str] = []  # every character consumed
        self.name: str | None = None
        self.arguments: list[str] | None = None  # all arguments text so far (None: no key yet)
        self.announced = False  # the name was handed out
        self.done = False
        self.failed = False

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the end of the object; the number of characters consumed."""
        i, n = 0, len(text)
        while i < n and not (self.done or self.failed):
            ch = text[i]
            state = self._state
            if state == _VALUE:
                i = self._scan_value(text, i)
                continue
            if ch in _WS and state != _IN_KEY:
                pass
            elif state == _BEFORE:
                if ch != "{":
                    self.failed = True
                    break
                self._state = _KEY
            elif state == _KEY:
                if ch == "}" and self._first_key:
                    self.raw.append(ch)
                    self._end()
                    return i + 1
                if ch != '"':
                    self.failed = True
                    break
                self._key = []
                self._state = _IN_KEY
            elif state == _IN_KEY:
                if ch == '"' and not self._esc:
                    if not self._on_key():
                        break
                    self._state = _COLON
                else:
                    self._esc = ch == "\\" and not self._esc
                    self._key.append(ch)
            elif state == _COLON:
                if ch != ":":
                    self.failed = True
                    break
                self._state = _VALUE_START
            elif state == _VALUE_START:
                if self._key_name() in self._args_keys:
                    if ch != "{":
                        self.failed = True  # arguments are an object
                        break
                    self.arguments = []
                self._state = _VALUE
                self._value = []
                self._value_kind = ch
                self._depth = 0
                self._in_str = False
                self._esc = False
                continue  # the value scanner takes this character
            elif state == _AFTER_VALUE:
                if ch == ",":
                    self._state = _KEY
                    self._first_key = False
                elif ch == "}":
                    self.raw.append(ch)
                    self._end()
                    return i + 1
                else:
                    self.failed = True
                    break
            self.raw.append(ch)
            i += 1
        return i

    def _scan_value(self, text: str, i: int) -> int:
        """Scan the current value from ``text[i]``; return where scanning stopped."""
        start = i
        n = len(text)
        kind = self._value_kind
        ended = False
        if kind in "{[":
            depth, in_str, esc = self._depth, self._in_str, self._esc
            while i < n:
                ch = text[i]
                i += 1
                if in_str:
                    if esc:
                        esc = False
                    elif ch == "\\":
                        esc = True
                    elif ch == '"':
                        in_str = False
                elif ch == '"':
                    in_str = True
                elif ch in "{[":
                    depth += 1
                elif ch in "}]":
                    depth -= 1
                    if depth == 0:
                        ended = True
                        break
            self._depth, self._in_str, self._esc = depth, in_str, esc
        elif kind == '"':
            esc = self._esc
            first = not self._value
            while i < n:
                ch = text[i]
                i += 1
                if first:
                    first = False  # the opening quote
                elif esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    ended = True
                    break
            self._esc = esc
        else:
            # A number or a literal: it ends at the first character that cannot be part of it.
            while i < n and text[i] not in ",}]" and text[i] not in _WS:
                i += 1
            ended = i < n
        chunk = text[start:i]
        self._value.append(chunk)
        self.raw.append(chunk)
        if self.arguments is not None and self._key_name() in self._args_keys:
            self.arguments.append(chunk)
            self._args.append(chunk)
        if ended:
            self._on_value()
        return i

    def _key_name(self) -> str:
        return "".join(self._key)

    def _on_key(self) -> bool:
        try:
            key = json.loads('"' + "".join(self._key) + '"')
        except ValueError:
            key = None
        if key not in self._keys:
            self.failed = True  # not a call object (or a key no call format has)
            return False
        self._key = list(key)
        return True

    def _on_value(self) -> None:
        self._state = _AFTER_VALUE
        if self._key_name() != "name":
            return
        try:
            name = json.loads("".join(self._value))
        except ValueError:
            name = None
        if not isinstance(name, str) or (self._names is not None and name not in self._names):
            self.failed = True
            return
        self.name = name

    def _end(self) -> None:
        try:
            obj = json.loads("".join(self.raw))
        except ValueError:
            obj = None
        keys = [k for k in self._args_keys if isinstance(obj, dict) and k in obj]
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("name"), str)
            or len(keys) > 1
            or (keys and not isinstance(obj[keys[0]], dict))
        ):
            self.failed = True
            return
        if self.arguments is None:
            self.arguments = ["{}"]
            self._args = ["{}"]
        self.done = True

    def take(self) -> tuple[str | None, str]:
        """The name if it is newly due (it is, once known and the arguments began or the object
        ended), and the arguments' text since the last call (only once the name went out)."""
        if self.failed:
            return None, ""
        name = None
        if not self.announced:
            if self.name is None or (self.arguments is None and not self.done):
                return None, ""
            self.announced = True
            name = self.name
        args = "".join(self._args)
        self._args.clear()
        return name, args
