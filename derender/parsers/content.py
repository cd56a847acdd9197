"""Content text around tool calls, shared by the tool parsers that wrap calls in markers.

vLLM streams whitespace right before a tool call (`"\n\n"`, or `"Sure.\n\n"`'s
tail) but its non-streamed answer strips it; onehop strips it in both shapes
by holding trailing whitespace until the next text decides: more content
releases it, a call drops it (`take_held`), and at the end it is content only
when no call was made (after a call, trailing whitespace is dropped as vLLM's
full answer has it). Only the trailing run is held, so the result does not
depend on how the text was split into pieces.
"""

from __future__ import annotations


class ContentText:
    """Content of one choice while a tool parser is on."""

    __slots__ = ("_held", "out")

    def __init__(self) -> None:
        self.out: list[str] = []
        self._held: list[str] = []

    def add(self, text: str) -> None:
        """Text outside any call."""
        body = text.rstrip()
        if not body:
            self._held.append(text)
            return
        if self._held:
            self.out.extend(self._held)
            self._held.clear()
        self.out.append(body)
        if len(body) < len(text):
            self._held.append(text[len(body) :])

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
