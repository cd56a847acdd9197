"""The incremental detokenizer against the tokenizer's own one-shot decode."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.derender.detokenizer import ByteLevelDetokenizer, WindowDetokenizer, make_detokenizer
from engine.derender.errors import TokenIdOutOfRange
from engine.derender.text import TextParams, TextPipeline
from engine.derender.vocab import TokenVocab, vocab_for
from engine.qwen3.vocab import IM_END_ID, THINK_END_ID, THINK_START_ID

# 🫠 𓀀 🧬 䨻 are split over two or three byte tokens by the Qwen3 vocabulary.
SPLIT_CHARS = "🫠𓀀🧬䨻"
SAMPLE = f"naïve café 世界 😀🇫🇷 {SPLIT_CHARS} a\u0301 日本語 <think>x</think> done"


def decode_stream(vocab: TokenVocab, ids: list[int], *, skip: bool = True) -> list[str]:
    detok = make_detokenizer(vocab, skip_special_tokens=skip)
    return [detok.step(token_id) for token_id in ids] + [detok.finish()]


def test_qwen3_is_byte_level(qwen3_vocab: TokenVocab) -> None:
    assert qwen3_vocab.byte_level
    assert isinstance(make_detokenizer(qwen3_vocab), ByteLevelDetokenizer)


def test_multibyte_characters_split_across_tokens_never_emit_replacement(
    qwen3_tokenizer: Any, qwen3_vocab: TokenVocab
) -> None:
    text = f"😀{SPLIT_CHARS}世界"
    ids = qwen3_tokenizer.encode(text)
    assert len(ids) > len(text), "the sample must contain characters split over byte tokens"
    deltas = decode_stream(qwen3_vocab, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert "" in deltas  # at least one token completed no character by itself


def test_genuine_replacement_character_passes_through(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    ids = qwen3_tokenizer.encode("a\ufffdb")
    assert "".join(decode_stream(qwen3_vocab, ids)) == "a\ufffdb"


def test_cut_mid_character_flushes_replacement_like_full_decode(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    ids = qwen3_tokenizer.encode("ok 🫠")
    cut = ids[:-1]
    deltas = decode_stream(qwen3_vocab, cut)
    assert deltas[-1] == "\ufffd", "held bytes are released at finish"
    assert "".join(deltas) == qwen3_tokenizer.decode(cut)


def test_prompt_ending_mid_character_emits_no_prompt_text(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    ids = qwen3_tokenizer.encode("x🫠")
    split = next(i for i in range(1, len(ids)) if "\ufffd" in qwen3_tokenizer.decode(ids[:i]))
    prompt, output = ids[:split], ids[split:]
    pipeline = TextPipeline(qwen3_vocab, TextParams(), prompt_token_ids=prompt)
    step = pipeline.feed(output, finish_reason="length")
    text = "".join(t for t, _ in step.pieces)
    assert "x" not in text
    assert text == qwen3_tokenizer.decode(output)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, skip: bool) -> None:
    ids = qwen3_tokenizer.encode("hi") + [IM_END_ID, THINK_START_ID] + qwen3_tokenizer.encode(" there")
    text = "".join(decode_stream(qwen3_vocab, ids, skip=skip))
    assert text == qwen3_tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is (not skip)
    assert "<think>" in text  # a non-special added token is text either way


def test_out_of_range_id_is_a_clean_error(qwen3_vocab: TokenVocab) -> None:
    pipeline = TextPipeline(qwen3_vocab, TextParams())
    with pytest.raises(TokenIdOutOfRange, match="out of range"):
        pipeline.feed([10, qwen3_vocab.size + 7])
    with pytest.raises(TokenIdOutOfRange):
        pipeline.feed([-1])


_INTERESTING = st.sampled_from([IM_END_ID, THINK_START_ID, THINK_END_ID, 151643, 151657, 151658])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_one_shot_decode(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, data: Any, skip: bool) -> None:
    """Any id sequence — byte tokens split anywhere, specials, markers — decodes like the tokenizer."""
    sample_ids = qwen3_tokenizer.encode(SAMPLE)
    ids = data.draw(
        st.lists(
            st.one_of(st.sampled_from(sample_ids), _INTERESTING, st.integers(0, qwen3_vocab.size - 1)),
            max_size=40,
        )
    )
    assert "".join(decode_stream(qwen3_vocab, ids, skip=skip)) == qwen3_tokenizer.decode(
        ids, skip_special_tokens=skip
    )


def _metaspace_tokenizer() -> Any:
    """A small SentencePiece-style (Metaspace + byte fallback) tokenizer built in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", "▁", "▁hello", "▁wor", "ld", "!", "▁a", "b"] + [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def test_window_detokenizer_on_a_non_byte_level_decoder() -> None:
    """Strip/ByteFallback decoders are not prefix-stable (DERENDER_CASES 2): no crash, no duplicates."""
    tokenizer = _metaspace_tokenizer()
    vocab = vocab_for(tokenizer)
    assert not vocab.byte_level
    euro = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    ids = [2, 3, 4, 5, 6, *euro, 7, 2]
    detok = make_detokenizer(vocab)
    assert isinstance(detok, WindowDetokenizer)
    deltas = [detok.step(i) for i in ids] + [detok.finish()]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
