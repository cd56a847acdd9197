"""vLLM's own reasoning and tool parsers, in-process, for the names onehop lacks (vllm backend).

onehop parses natively every family in `derender.parsers`. On the vllm
backend a `--reasoning-parser` / `--tool-parser` name that only vLLM knows is
served by vLLM's parser instead of refused. Who runs what (`owners`):

- reasoning onehop's (or none), tools vLLM's: onehop's reasoning stage hands
  its content pieces to vLLM's tool parser, wrapped as onehop's tool stage
  (`VLLMTools` in a plain `ParserSet`), so reasoning keeps onehop's markers,
  stop-string care and token counts;
- reasoning vLLM's: vLLM parses the pair with one `Parser`, composed as its
  coupled server composes it (`VLLMParserSet`): onehop's tool parsers need
  marker token ids, which vLLM's reasoning output (text) no longer carries.

Either way each choice owns one vLLM `Parser` for the request's life, fed each
step's new text and token ids once through `parse_delta` (never a replay), as
vLLM 0.32's coupled `/v1/chat/completions` does; its `DeltaMessage`s become
onehop's (reasoning, content, `ToolDelta`s). A step is parsed when drained, so
the output's last step reaches vLLM with `finished=True`, as in vLLM.

vLLM is imported inside functions only: this module imports without it.

Limits: `tool_choice` required or named acts as `auto` here (onehop forces a
call by a prompt prefix for its own families only; vLLM by guided decoding at
generation). vLLM-parsed `reasoning_tokens` are counted at finish, so
continuous usage reports 0 before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from derender.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ParseOptions,
    ParserSet,
    ToolDelta,
    UnknownParser,
    bind_reasoning,
)
from derender.parsers.base import BoundTools, Markers, ToolParser, marker_of
from derender.stop import Piece
from derender.vocab import TokenVocab

Owner = Literal["onehop", "vllm"]
ParserKind = Literal["reasoning", "tool"]
# vLLM's request wants a model name; its parsers never read it.
REQUEST_MODEL = "onehop"


def owners(reasoning: str | None, tool: str | None) -> dict[str, Owner]:
    """Each configured name → who parses it (see the module docstring for the rule)."""
    native_reasoning = reasoning is None or reasoning in REASONING_PARSERS
    who: dict[str, Owner] = {}
    if reasoning is not None:
        who[reasoning] = "onehop" if native_reasoning else "vllm"
    if tool is not None:
        who[tool] = "onehop" if native_reasoning and tool in TOOL_PARSERS else "vllm"
    return who


def vllm_parser_names(kind: ParserKind) -> frozenset[str]:
    """The names in vLLM's registry of this kind (imports vLLM)."""
    if kind == "reasoning":
        from vllm.reasoning import ReasoningParserManager

        return frozenset(ReasoningParserManager.list_registered())
    from vllm.tool_parsers import ToolParserManager

    return frozenset(ToolParserManager.list_registered())


def bind_vllm_parsers(
    vocab: TokenVocab, tokenizer: Any, reasoning: str | None, tool: str | None, *, model_config: Any = None
) -> None:
    """Pre-bind `vocab.parsers[(reasoning, tool)]` where vLLM parses a stage, so `bind_parsers`
    finds it; `tokenizer` is vLLM's (`AsyncLLM.tokenizer`), `model_config` vLLM's, if any."""
    who = owners(reasoning, tool)
    if "vllm" not in who.values():
        return
    bound: VLLMParserSet | ParserSet
    if reasoning is not None and who[reasoning] == "vllm":
        bound = VLLMParserSet(tokenizer, reasoning, tool, model_config=model_config)
    else:
        assert tool is not None
        native = bind_reasoning(vocab, reasoning) if reasoning is not None else None
        bound = ParserSet(native, VLLMTools(vocab, tokenizer, tool, model_config=model_config))
    vocab.parsers[(reasoning, tool)] = bound


def compose_parser(tokenizer: Any, reasoning: str | None, tool: str | None, model_config: Any = None) -> type[Any]:
    """vLLM's `Parser` class for these names, as its chat server composes it (auto tools on)."""
    from vllm.parser import ParserManager

    model_type = getattr(getattr(model_config, "hf_config", None), "model_type", None)
    try:
        parser_cls = ParserManager.get_parser(
            tool_parser_name=tool,
            reasoning_parser_name=reasoning,
            enable_auto_tools=True,
            is_harmony=model_type == "gpt_oss",
            tokenizer=tokenizer,
        )
    except TypeError as exc:  # vLLM's way of saying unregistered, or not for this tokenizer
        raise UnknownParser(f"vLLM cannot parse reasoning {reasoning!r}, tool {tool!r}: {exc}") from exc
    if not isinstance(parser_cls, type):  # None: no parser by these names
        raise UnknownParser(f"vLLM has no parser for reasoning {reasoning!r}, tool {tool!r}")
    return parser_cls


def vllm_request(options: ParseOptions) -> Any:
    """The vLLM `ChatCompletionRequest` its parsers read: tools, tool_choice, parallel calls, kwargs."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tools = [_tool(schema.name, schema.parameters) for schema in options.tools]
    kwargs = dict(options.chat_template_kwargs)
    if not options.enable_thinking:
        kwargs.setdefault("enable_thinking", False)
    return ChatCompletionRequest(
        model=REQUEST_MODEL,
        messages=[],
        tools=tools or None,
        tool_choice=("auto" if options.tools_enabled else "none") if tools else None,
        parallel_tool_calls=options.parallel_tool_calls,
        chat_template_kwargs=kwargs or None,
    )


def _tool(name: str, parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = dict(parameters)
    return {"type": "function", "function": function}


class VLLMStream:
    """One choice's vLLM `Parser`: pending text and ids in, onehop's deltas out."""

    __slots__ = (
        "_done",
        "_finishing",
        "_held",
        "_index",
        "_new_id",
        "_prompt",
        "_request",
        "_sent",
        "_single",
        "_text",
        "parser",
        "token_ids",
    )

    def __init__(
        self,
        parser_cls: type[Any],
        tokenizer: Any,
        options: ParseOptions,
        prompt_token_ids: Sequence[int],
        model_config: Any = None,
    ) -> None:
        request = vllm_request(options)
        self.parser = parser_cls(
            tokenizer, request.tools, chat_template_kwargs=request.chat_template_kwargs, model_config=model_config
        )
        # What vLLM's renderer does to the request before its serving parses with it.
        self._request = self.parser.adjust_request(request)
        self._prompt = list(prompt_token_ids)
        self._text: list[str] = []
        self.token_ids: list[int] = []
        """Every id fed (what `count_reasoning_tokens` reads)."""
        self._sent = 0
        self._finishing = False
        self._done = False
        self._new_id = options.new_id
        self._single = not options.parallel_tool_calls
        self._index: dict[int, int] = {}
        """vLLM's call index → onehop's (headers in order, 0..k-1)."""
        self._held: dict[int, list[str]] = {}

    @property
    def calls(self) -> int:
        return len(self._index)

    def add(self, pieces: Sequence[Piece]) -> None:
        for text, token_id in pieces:
            if text:
                self._text.append(text)
            if token_id >= 0:
                self.token_ids.append(token_id)

    def finish(self) -> None:
        self._finishing = True

    def drain(self) -> tuple[str, str, list[ToolDelta]]:
        """Parse what was added since the last drain: (reasoning, content, tool deltas)."""
        ids = self.token_ids[self._sent :]
        if self._done or not (self._text or ids or self._finishing):
            return "", "", []
        text = "".join(self._text)
        self._text = []
        self._sent = len(self.token_ids)
        self._done = self._finishing
        delta = self.parser.parse_delta(text, ids, self._request, self._prompt, finished=self._finishing)
        if delta is None:
            return "", "", []
        return delta.reasoning or "", delta.content or "", self._tool_deltas(delta.tool_calls)

    def _tool_deltas(self, calls: Sequence[Any]) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        for call in calls:
            if self._single and call.index != 0:
                continue  # parallel_tool_calls=false: the first call only, as vLLM's serving filters
            function = call.function
            name = function.name if function is not None else None
            arguments = function.arguments if function is not None else None
            index = self._index.get(call.index)
            if index is None:
                if not name:  # a fragment before its header: held until the header comes
                    if arguments:
                        self._held.setdefault(call.index, []).append(arguments)
                    continue
                index = self._index[call.index] = len(self._index)
                out.append(ToolDelta(index, id=call.id or self._new_id(), name=name))
                held = self._held.pop(call.index, None)
                if held:
                    out.append(ToolDelta(index, arguments="".join(held)))
            if arguments:
                out.append(ToolDelta(index, arguments=arguments))
        return out


# ------------------------------------------------------------ vLLM parses the pair


class VLLMChoice:
    """A choice parsed by vLLM alone (`ChoiceParsing`)."""

    __slots__ = ("_stream", "reasoning_tokens")

    def __init__(self, stream: VLLMStream) -> None:
        self._stream = stream
        self.reasoning_tokens = 0

    @property
    def calls(self) -> int:
        return self._stream.calls

    def feed(self, pieces: Sequence[Piece]) -> None:
        self._stream.add(pieces)

    def finish(self) -> None:
        self._stream.finish()
        # Read before the final drain: a count over the ids, which are all in by now.
        self.reasoning_tokens = self._stream.parser.count_reasoning_tokens(self._stream.token_ids)

    def drain(self) -> tuple[str, str, list[ToolDelta]]:
        return self._stream.drain()


class VLLMParserSet:
    """vLLM's parsers for a (reasoning, tool) pair, bound to its tokenizer (`BoundParsers`).

    No markers: the text route never reaches it (the gateway has no parser for
    these names) and vLLM's parsers read text, so stop strings may cut anywhere.
    """

    __slots__ = ("_cls", "_forced_cls", "_model_config", "_tokenizer", "atomic_ids", "marker_ids")

    def __init__(self, tokenizer: Any, reasoning: str | None, tool: str | None, *, model_config: Any = None) -> None:
        self.marker_ids: Mapping[str, int] = {}
        self.atomic_ids: frozenset[int] = frozenset()
        self._tokenizer = tokenizer
        self._model_config = model_config
        self._cls = compose_parser(tokenizer, reasoning, tool, model_config)
        # A forced call (a native tool family's prefix in the prompt) starts with no reasoning.
        self._forced_cls = compose_parser(tokenizer, None, tool, model_config) if tool is not None else self._cls

    def new(self, options: ParseOptions, prompt_token_ids: Sequence[int], *, forced: bool) -> VLLMChoice:
        parser_cls = self._forced_cls if forced else self._cls
        return VLLMChoice(VLLMStream(parser_cls, self._tokenizer, options, prompt_token_ids, self._model_config))


# ------------------------------------------------------------ vLLM parses the tool stage


class VLLMToolStage(ToolParser):
    """vLLM's tool parser as onehop's tool stage, fed the content after onehop's reasoning."""

    def __init__(self, stream: VLLMStream, strays: Mapping[int, str]) -> None:
        self._stream = stream
        self._strays = strays
        self.calls = 0

    def feed(self, pieces: Sequence[Piece]) -> None:
        strays = self._strays
        if strays:
            pieces = [_without(piece, marker_of(piece, strays)) for piece in pieces]
        self._stream.add(pieces)

    def finish(self) -> None:
        self._stream.finish()

    def drain(self) -> tuple[str, list[ToolDelta]]:
        _, content, deltas = self._stream.drain()
        self.calls = self._stream.calls
        return content, deltas


class VLLMTools(BoundTools):
    """vLLM's tool parser bound to onehop's vocabulary and vLLM's tokenizer.

    Its markers are the parser's `tool_call_start_token` / `tool_call_end_token`
    where it names them (most of vLLM's do) and they are single tokens: stop
    strings then never split them, and onehop's reasoning ends at the start one
    as it does before its own families' calls.
    """

    def __init__(self, vocab: TokenVocab, tokenizer: Any, name: str, *, model_config: Any = None) -> None:
        self._tokenizer = tokenizer
        self._model_config = model_config
        self._cls = compose_parser(tokenizer, None, name, model_config)
        probe = self._cls(tokenizer).tool_parser
        start = _single_token(vocab, getattr(probe, "tool_call_start_token", None))
        end = _single_token(vocab, getattr(probe, "tool_call_end_token", None))
        self.markers = Markers(vocab, [text for text in (start, end) if text is not None])
        self.starts = {self.markers.id(start): start} if start is not None else {}

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        # No prompt: it only sets vLLM's reasoning state, and onehop's stage owns reasoning here.
        return VLLMToolStage(VLLMStream(self._cls, self._tokenizer, options, (), self._model_config), strays)


def _single_token(vocab: TokenVocab, text: object) -> str | None:
    return text if isinstance(text, str) and text and vocab.token_id(text) is not None else None


def _without(piece: Piece, marker: str | None) -> Piece:
    """A stray marker's text dropped from its piece (the id stays: the token was generated)."""
    return piece if marker is None else (piece[0][: len(piece[0]) - len(marker)], piece[1])
