"""vLLM's KV cache events: what an engine publishes when it stores or evicts prefix-cache blocks.

The wire (vLLM's `vllm/distributed/kv_events.py`, `--kv-events-config`): a ZMQ PUB socket
sends one multipart message per batch, `[topic, seq, payload]`, `seq` an 8-byte big-endian
counter from 0 and `payload` a msgpack `EventBatch` `[ts, events, data_parallel_rank]`. A
ROUTER replay socket, when configured, answers a start seq (8 bytes, after an empty
delimiter frame) with `[b"", topic, seq, payload]` for every batch it still holds from
there, then `[b"", b"", END_SEQ, b""]`. Data-parallel rank r publishes on port + r.

Each event is tagged by its class name. vLLM writes a map since mid-2026
(`{"type": "BlockStored", "block_hashes": [...], ...}`); earlier releases wrote a
positional array (`["BlockStored", block_hashes, parent_block_hash, token_ids, ...]`). Both
decode here (`decode_batch`), and both encode (`encode_batch`, for the sim engine).

Block hashes are the engine's own (by default the low 64 bits of its hash, as ints; bytes
on some configurations): a reader keys its index by what it computes from `token_ids`,
and keeps the engine's hash only to apply removals.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

BlockHash = int | bytes
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last frame's seq: nothing more to replay."""


class BlockStored(Struct, tag=True, omit_defaults=True, kw_only=True):
    """`block_hashes[i]` holds `token_ids[i * block_size : (i + 1) * block_size]`, chained on
    `block_hashes[i - 1]` (the first on `parent_block_hash`, None at the prompt's start)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    """Per block: the LoRA name, multimodal `(identifier, offset)` pairs, the cache salt, ...
    in the order vLLM hashes them (None: nothing but tokens)."""
    group_idx: int | None = None
    session_id: str | None = None


class BlockRemoved(Struct, tag=True, omit_defaults=True, kw_only=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(Struct, tag=True, omit_defaults=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _StoredArray(Struct, tag="BlockStored", array_like=True):
    """The positional encoding of vLLM's releases before mid-2026."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None


class _RemovedArray(Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _ClearedArray(Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _Batch(Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class EventBatch(Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class KVEventsError(ValueError):
    """A payload that is not a batch of KV events (truncated, not msgpack, an unknown event)."""


_BATCH = msgspec.msgpack.Decoder(_Batch)
_MAP = msgspec.msgpack.Decoder(Event)
_MAPS = msgspec.msgpack.Decoder(EventBatch)
_ARRAY = msgspec.msgpack.Decoder(_StoredArray | _RemovedArray | _ClearedArray)
_ENCODER = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> EventBatch:
    """One published payload, each event in either encoding; raises `KVEventsError`.
    Today's encoding (maps) in one pass; a batch that is not, event by event."""
    try:
        return _MAPS.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    try:
        batch = _BATCH.decode(payload)
        return EventBatch(batch.ts, [_event(raw) for raw in batch.events], batch.data_parallel_rank)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVEventsError(f"not a KV event batch: {exc}") from exc


def _event(raw: msgspec.Raw) -> Event:
    head = memoryview(raw)[:1].tobytes()
    if head and (0x90 <= head[0] <= 0x9F or head[0] in (0xDC, 0xDD)):  # a msgpack array
        old = _ARRAY.decode(raw)
        if isinstance(old, _StoredArray):
            return BlockStored(**msgspec.structs.asdict(old))
        if isinstance(old, _RemovedArray):
            return BlockRemoved(**msgspec.structs.asdict(old))
        return AllBlocksCleared()
    return _MAP.decode(raw)


def encode_batch(batch: EventBatch, encoding: Literal["map", "array"] = "map") -> bytes:
    """`batch` as vLLM publishes it: events as maps (today's vLLM) or positional arrays (older)."""
    if encoding == "map":
        return _ENCODER.encode(batch)
    events: list[Any] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            fields = msgspec.structs.asdict(event)
            events.append(_StoredArray(**{name: fields[name] for name in _StoredArray.__struct_fields__}))
        elif isinstance(event, BlockRemoved):
            events.append(_RemovedArray(event.block_hashes, event.medium))
        else:
            events.append(_ClearedArray())
    raw = [msgspec.Raw(_ENCODER.encode(event)) for event in events]
    return _ENCODER.encode(_Batch(batch.ts, raw, batch.data_parallel_rank))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """A message's seq frame; raises `KVEventsError` for one that is not 8 bytes."""
    if len(frame) != 8:
        raise KVEventsError(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
