"""vLLM's own KV event classes, encoded as its publisher does, decode here and feed the index.

The batch is built and encoded in vLLM's venv (a subprocess), read back in the project's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway.routing.kv_index import KVIndex, request_extra_keys
from tests.vllm.conftest import ROOT, server_env
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

pytestmark = pytest.mark.vllm

ENCODE = """
import sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

stored = dict(token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU")
batches = [
    KVEventBatch(ts=1.0, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, lora_name=None, **stored),
        BlockStored(block_hashes=[21, 22], parent_block_hash=None, lora_name="my-lora",
                    extra_keys=[("my-lora", "salt"), ("my-lora",)], **stored),
    ], data_parallel_rank=0),
    KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[12], medium="GPU"), AllBlocksCleared()]),
]
encoder = msgspec.msgpack.Encoder()
sys.stdout.write("\\n".join(encoder.encode(batch).hex() for batch in batches))
"""
ENCODE_TIMEOUT_S = 120.0


def test_vllms_event_batches_decode_and_index(vllm_python: Path) -> None:
    done = subprocess.run(
        [str(vllm_python), "-c", ENCODE], cwd=ROOT, env=server_env(), capture_output=True, timeout=ENCODE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    first, second = (decode_batch(bytes.fromhex(line)) for line in done.stdout.decode().split())
    assert first.data_parallel_rank == 0 and [type(event) for event in first.events] == [BlockStored, BlockStored]
    assert [type(event) for event in second.events] == [BlockRemoved, AllBlocksCleared]

    index = KVIndex(block_size=16)
    index.apply("http://engine", first.events)
    prompt = list(range(32))
    assert index.match(prompt) == {"http://engine": 2}
    assert index.match(prompt, request_extra_keys(2, lora_name="my-lora", cache_salt="salt")) == {"http://engine": 2}
    index.apply("http://engine", second.events[:1])
    assert index.match(prompt) == {"http://engine": 1}
    index.apply("http://engine", second.events[1:])
    assert index.size == 0
