"""Reasoning between a start and an end marker (`<think>` … `</think>`): Qwen3 and kin.

States of one choice:

    REASONING --end-------> DONE   (the end marker is dropped)
    REASONING --start-----> REASONING  (a start marker is absorbed)
    REASONING --tool start-> DONE  (implicit end; the marker goes on to the tool parser)
    DONE: every piece is content; a duplicate end marker is dropped outside calls.

Whether a choice starts in REASONING comes from the rendered prompt: the
generation turn is scanned back to its opening token (DERENDER_CASES 12).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from derender.parsers.base import BoundReasoning, Markers, ParseOptions, ReasoningParser
from derender.parsers.marker_tokens import add_held
from derender.stop import Piece
from derender.vocab import TokenVocab


@dataclass(frozen=True, slots=True)
class ThinkSyntax:
    start: str
    end: str
    turn_start: str
    """Token that opens a chat turn; the prompt is scanned back to it for markers."""
    tool_ends_reasoning: bool = True
    """A tool-call opening inside reasoning ends it (Qwen3's grammar does this)."""
    default_reasoning: bool | None = None
    """The start state when the generation turn has no marker: None follows
    `enable_thinking` (Qwen3); a family that ignores it fixes it here."""
    drop_stray_end: bool = True
    """A second end marker is dropped from content (Qwen3); False keeps its text."""
    strip_trailing_space: bool = False
    """Whitespace that ends the reasoning is dropped (MiniMax M2's vLLM grammar); held
    while reasoning goes on, so no chunking changes the text."""
    count_specials: bool = True
    """Special tokens inside reasoning count as reasoning tokens. False (MiniMax M2): vLLM's
    grammar drops them uncounted, the EOS that ends an unclosed block (`("", id)` here) too."""


def format_think(syntax: ThinkSyntax, text: str) -> str:
    """A reasoning block as Qwen3 writes it: the markers on their own lines, a blank line after."""
    return f"{syntax.start}\n{text}\n{syntax.end}\n\n"


class BoundThink(BoundReasoning):
    def __init__(self, vocab: TokenVocab, syntax: ThinkSyntax) -> None:
        self.syntax = syntax
        self.markers = Markers(vocab, (syntax.start, syntax.end))
        self._start = self.markers.id(syntax.start)
        self._end = self.markers.id(syntax.end)
        self.strays = {self._end: syntax.end} if syntax.drop_stray_end else {}
        self.end_ids = frozenset({self._end})
        turn = vocab.token_id(syntax.turn_start)
        self._turn = -1 if turn is None else turn
        self.uncounted: frozenset[int] = vocab.special_ids if not syntax.count_specials else frozenset()

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int], options: ParseOptions) -> bool:
        """A trailing `</think>` in the prompt (as `enable_thinking=false` renders) means
        content; a trailing `<think>` (a template that pre-opens it) means reasoning.
        With neither, reasoning is on unless thinking was disabled: Qwen3 opens
        `<think>` itself and that marker is absorbed."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self._end:
                return False
            if token_id == self._start:
                return True
            if token_id == self._turn:
                break
        default = self.syntax.default_reasoning
        return options.enable_thinking if default is None else default

    def new(self, options: ParseOptions, *, in_reasoning: bool, tool_starts: Mapping[int, str]) -> ReasoningParser:
        return ThinkReasoning(
            self,
            in_reasoning=in_reasoning,
            tool_starts=tool_starts if self.syntax.tool_ends_reasoning else {},
            strip_trailing_space=self.syntax.strip_trailing_space,
        )


_START, _END, _TOOL = range(3)


class ThinkReasoning(ReasoningParser):
    __slots__ = ("_by_id", "_done", "_space", "_uncounted", "reasoning_tokens")

    def __init__(
        self,
        bound: BoundThink,
        *,
        in_reasoning: bool,
        tool_starts: Mapping[int, str],
        strip_trailing_space: bool = False,
    ) -> None:
        by_id: dict[int, tuple[int, str]] = {token_id: (_TOOL, text) for token_id, text in tool_starts.items()}
        by_id[bound.markers.id(bound.syntax.start)] = (_START, bound.syntax.start)
        by_id[bound.markers.id(bound.syntax.end)] = (_END, bound.syntax.end)
        self._by_id = by_id
        self._uncounted = bound.uncounted
        self._done = not in_reasoning
        self._space: list[str] | None = [] if strip_trailing_space else None
        """The trailing whitespace run of the reasoning so far, when it is stripped."""
        self.reasoning_tokens = 0

    def feed(self, pieces: Sequence[Piece], reasoning: list[str]) -> Sequence[Piece]:
        if self._done:
            return pieces
        by_id, space, uncounted = self._by_id, self._space, self._uncounted
        for i, (text, token_id) in enumerate(pieces):  # hot loop while reasoning
            marker = by_id.get(token_id)
            if marker is None or not text.endswith(marker[1]):
                if text:
                    if space is None:
                        reasoning.append(text)
                    else:
                        add_held(text, reasoning, space)
                if token_id >= 0 and token_id not in uncounted:
                    self.reasoning_tokens += 1
                continue
            head = text[: len(text) - len(marker[1])]
            if head:
                if space is None:
                    reasoning.append(head)
                else:
                    add_held(head, reasoning, space)
            kind = marker[0]
            if kind == _START:
                continue
            self._done = True
            if space:
                space.clear()
            rest = pieces[i + 1 :]
            if kind == _TOOL:
                return [(marker[1], token_id), *rest]
            return rest
        return ()

    def finish(self, reasoning: list[str]) -> Sequence[Piece]:
        if self._space:
            self._space.clear()
        return ()
