"""Content text around tool calls, shared by the tool parsers that wrap calls in markers.

vLLM streams whitespace-only content before a tool call (`"\\n\\n"`) but its
non-streamed answer has `content: null`; onehop gives `null` in both shapes by
holding whitespace: before any content (dropped if a call comes first) and
after a call (dropped unless more text follows). Only the trailing run is held,
so the result does not depend on how the text was split into pieces.
"""

from __future__ import annotations


class ContentText:
    """Content of one choice while a tool parser is on."""

    __slots__ = ("out", "_held", "_started")

    def __init__(self) -> None:
        self.out: list[str] = []
        self._held: list[str] = []
        self._started = False

    def add(self, text: str, *, calls: int) -> None:
        """Text outside any call; `calls` is how many calls were emitted so far."""
        if self._started and not calls:
            self.out.append(text)
            return
        body = text.rstrip()
        if not body:
            self._held.append(text)
            return
        if self._held:
            self.out.extend(self._held)
            self._held.clear()
        if calls:
            self.out.append(body)
            if len(body) < len(text):
                self._held.append(text[len(body) :])
        else:
            self.out.append(text)
        self._started = True

    def take_held(self) -> list[str]:
        """The whitespace held right before a call opens (given back if it never becomes one)."""
        held = self._held
        self._held = []
        return held

    def finish(self, *, calls: int) -> None:
        """Held whitespace is content only when no call was made."""
        if self._held and not calls:
            self.out.extend(self._held)
        self._held.clear()

    def drain(self) -> str:
        out = self.out
        if not out:
            return ""
        self.out = []
        return "".join(out)
