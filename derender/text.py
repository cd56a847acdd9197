"""Token ids → released text pieces for one choice: detokenizer + stop strings.

This is the part chat and completions share, and the part the engine runs in
`text` mode: it decides the final text and `finish_reason`/`stop_reason`
from the token stream and the finish the backend reported.

Token ids versus text (DERENDER_CASES 8): a backend that stopped on EOS or a
stop token id still reports that token in `token_ids`; its text is left out
unless `include_stop_str_in_output`. A stop *string* cuts the text, and ids
after the token that completed it are dropped. Re-running this over the ids
the engine returned therefore reproduces exactly the engine's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from derender.detokenizer import make_detokenizer
from derender.stop import Piece, StopStrings
from derender.vocab import TokenVocab


@dataclass(frozen=True, slots=True)
class TextParams:
    """The sampling fields that shape output text."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0


class TextStep(msgspec.Struct, gc=False):  # one a step: a Struct builds in a quarter of a dataclass's time
    pieces: list[Piece]
    """Text released by this step, in order."""
    kept: int
    """How many of the step's token ids survive a stop-string cut."""
    finish_reason: str | None
    stop_reason: int | str | None


class OutputFinished(RuntimeError):
    """Tokens arrived for a choice that already finished."""


def ends_on_stop_token(finish_reason: str | None, stop_reason: int | str | None) -> bool:
    """Whether the last reported id is the EOS / stop token that ended the output."""
    return finish_reason == "stop" and not isinstance(stop_reason, str)


class TextPipeline:
    __slots__ = ("_detok", "_include_stop", "_stop", "_vocab", "finished")

    def __init__(
        self,
        vocab: TokenVocab,
        params: TextParams,
        *,
        atomic_ids: frozenset[int] = frozenset(),
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._vocab = vocab
        self._detok = make_detokenizer(
            vocab,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            prompt_token_ids=prompt_token_ids,
        )
        self._stop = (
            StopStrings(
                params.stop,
                include_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
                atomic_ids=atomic_ids,
            )
            if params.stop
            else None
        )
        self._include_stop = params.include_stop_str_in_output
        self.finished = False

    def feed(
        self,
        token_ids: Sequence[int],
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> TextStep:
        """Decode one step; `finish_reason` set means this is the choice's last step."""
        if self.finished:
            raise OutputFinished("tokens arrived after the choice finished")
        self._vocab.check_ids(token_ids)
        decoded = token_ids
        silent: int | None = None  # the EOS / stop token: its id is kept, its text is not
        if (
            finish_reason is not None
            and token_ids
            and not self._include_stop
            and ends_on_stop_token(finish_reason, stop_reason)
        ):
            decoded = token_ids[:-1]
            silent = token_ids[-1]
        step = self._detok.step
        if len(decoded) == 1:  # the usual step: one token
            pieces: list[Piece] = [(step(decoded[0]), decoded[0])]
        else:
            pieces = [(step(token_id), token_id) for token_id in decoded]
        if finish_reason is not None:
            tail = self._detok.finish()
            if tail:
                pieces.append((tail, -1))
        kept = len(token_ids)
        stop = self._stop
        if stop is not None:
            pieces, hit = stop.feed(pieces)
            if hit is not None:
                kept = min(hit.kept, len(token_ids))
                finish_reason, stop_reason = "stop", hit.stop
            elif finish_reason is not None:
                pieces += stop.finish()
        if silent is not None and kept == len(token_ids):
            pieces.append(("", silent))
        if finish_reason is not None:
            self.finished = True
        return TextStep(pieces=pieces, kept=kept, finish_reason=finish_reason, stop_reason=stop_reason)
