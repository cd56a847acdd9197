"""A rendered prompt's two forms (`TokenIds`): the ids and their JSON text agree through joins,
and an engine request carries the text exactly as it would carry the list."""

from __future__ import annotations

import msgspec

from gateway.render.token_ids import TokenIds, json_ids
from gateway.upstream.engine_request import generate_body
from gateway.upstream.remote import RemoteChatDerender
from tests.support.token_ids import id_list


def test_joined_parts_hold_their_ids_and_text_in_order_and_skip_empty_ones() -> None:
    parts = [TokenIds.encoded([151644, 872, 198]), TokenIds(), TokenIds([0, 7]), TokenIds.encoded([4_294_967_295])]
    joined = TokenIds.joined(parts)
    assert id_list(joined) == [151644, 872, 198, 0, 7, 4_294_967_295]
    assert joined.items == b"151644,872,198,0,7,4294967295"
    assert id_list(TokenIds.joined([TokenIds()])) == [] and TokenIds.joined([]).items == b""


def test_a_joined_prompt_is_a_copy_of_its_parts() -> None:
    """The turn cache hands out its entries: growing a prompt must never grow them."""
    part = TokenIds([1, 2])
    joined = TokenIds.joined([part])
    joined += TokenIds([3])
    assert id_list(part) == [1, 2] and part.items == b"1,2"


def test_an_engine_request_carries_the_text_as_it_would_the_list() -> None:
    ids = [*range(150_000, 150_040), 0, 1, 9]
    fields = {"request_id": "r", "model": "m", "sampling": {"max_tokens": 3}, "route": "text", "stream": True}
    as_list = generate_body(prompt_ids=ids, **fields)  # type: ignore[arg-type]
    rendered = TokenIds.joined([TokenIds.encoded(ids[:20]), TokenIds.encoded(ids[20:])])
    assert generate_body(prompt_ids=rendered, **fields) == as_list  # type: ignore[arg-type]
    decoded = msgspec.json.decode(as_list)
    assert decoded["token_ids"] == ids and decoded["request_id"] == "r" and decoded["sampling_params"] == {"max_tokens": 3}
    assert msgspec.json.encode(json_ids(rendered)) == msgspec.json.encode(ids)
    assert msgspec.json.encode(json_ids(tuple(ids))) == msgspec.json.encode(ids)


def test_a_derender_request_carries_the_clients_request_as_it_is() -> None:
    chat = b'{"messages": [{"role": "user", "content": "hi \\u00e9"}], "model": "m"}'
    body = generate_body(
        request_id="r", model=None, prompt_ids=TokenIds([1, 2]), sampling={"n": 1}, route="derender", stream=False,
        derender_fields={"chat_request": msgspec.Raw(chat)}, priority=3,
    )
    assert chat in body
    assert msgspec.json.decode(body) == {
        "token_ids": [1, 2], "request_id": "r", "sampling_params": {"n": 1}, "output_mode": "derender",
        "stream": False, "priority": 3, "chat_request": msgspec.json.decode(chat),
    }


def test_the_remote_derender_sends_the_rendered_ids_as_a_list() -> None:
    ids = [5, 10, 151_000]
    derender = RemoteChatDerender(None, "http://engine", model="m", chat_request=b"{}", prompt_token_ids=TokenIds(ids))  # type: ignore[arg-type]
    assert derender._prompt_ids == msgspec.json.encode(ids)
