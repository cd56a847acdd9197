"""The chat-template environment: what a template may not do, and how templates are picked."""

from __future__ import annotations

import pytest

from gateway.render.chat_template import ChatTemplate, ChatTemplateError, pick_template

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace() %}{% set ns._hidden = 1 %}",
        "{{ namespace(_hidden=1) }}",
        "{{ raise_exception('refused') }}",
        "{{ messages[0].content.missing.deeper }}",
    ],
)
def test_what_a_template_may_not_do_is_a_chat_template_error(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(HI)


def test_a_template_that_does_not_compile_is_refused_when_loaded() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_generation_blocks_render_their_body() -> None:
    source = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert ChatTemplate(source).render(HI) == "[hi]"


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "tokenize"])
def test_kwargs_may_not_set_render_options(key: str) -> None:
    with pytest.raises(ChatTemplateError, match=key):
        ChatTemplate("{{ messages | length }}").render(HI, kwargs={key: True})


def test_kwargs_override_special_tokens() -> None:
    template = ChatTemplate("{{ bos_token }}")
    assert template.render(HI, special_tokens={"bos_token": "<s>"}, kwargs={"bos_token": "<b>"}) == "<b>"


def test_tojson_keeps_text_and_takes_options() -> None:
    template = ChatTemplate("{{ {'b': '<é>', 'a': 1} | tojson(indent=1, sort_keys=true) }}")
    assert template.render(HI) == '{\n "a": 1,\n "b": "<é>"\n}'


def test_templates_are_picked_as_transformers_picks_them() -> None:
    default, tool_use = ChatTemplate("d"), ChatTemplate("t")
    assert pick_template({"default": default, "tool_use": tool_use}, tools=True) is tool_use
    assert pick_template({"default": default, "tool_use": tool_use}, tools=False) is default
    with pytest.raises(ChatTemplateError, match="none is named default"):
        pick_template({"tool_use": tool_use}, tools=False)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        pick_template({}, tools=False)
