"""The incremental detokenizer against the tokenizer's own one-shot decode."""

from __future__ import annotations

import codecs
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from derender.detokenizer import ByteLevelDetokenizer, WindowDetokenizer, make_detokenizer
from derender.errors import TokenIdOutOfRange
from derender.text import TextParams, TextPipeline
from derender.vocab import TokenVocab, vocab_for
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


def test_cut_mid_character_drops_it_and_its_space(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    """Issue #27: `max_tokens` ending inside a character gives neither U+FFFD nor the space
    of the token that began it (vLLM's incremental detokenizer drops both)."""
    ids = qwen3_tokenizer.encode("ok 🫠")
    cut = ids[:-1]
    assert qwen3_tokenizer.decode(cut) == "ok \ufffd", "the cut must fall inside the character"
    deltas = decode_stream(qwen3_vocab, cut)
    assert "".join(deltas) == "ok"


def test_held_space_comes_out_with_the_completed_character(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    ids = qwen3_tokenizer.encode("ok 🫠!")
    deltas = decode_stream(qwen3_vocab, ids)
    assert "".join(deltas) == "ok 🫠!"
    assert " 🫠" in deltas, "the space waits for its character, then both go out in one delta"


def test_added_token_after_a_partial_character_flushes_replacement(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    """Mid-output the character can no longer complete: U+FFFD, as a full decode shows."""
    ids = [*qwen3_tokenizer.encode("ok 🫠")[:-1], THINK_START_ID]
    assert "".join(decode_stream(qwen3_vocab, ids)) == qwen3_tokenizer.decode(ids) == "ok \ufffd<think>"


@pytest.mark.parametrize("prompt", ["", "x"])
def test_pipeline_cut_by_length_mid_character(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, prompt: str) -> None:
    """Streamed one token a step or all at once, the finish drops the incomplete character."""
    ids = qwen3_tokenizer.encode("naïve 世界 🫠")[:-1]
    for steps in ([ids], [[token_id] for token_id in ids]):
        pipeline = TextPipeline(qwen3_vocab, TextParams(), prompt_token_ids=qwen3_tokenizer.encode(prompt))
        pieces = [
            piece
            for i, chunk in enumerate(steps)
            for piece in pipeline.feed(chunk, finish_reason="length" if i == len(steps) - 1 else None).pieces
        ]
        assert "".join(text for text, _ in pieces) == "naïve 世界"


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
    ids = [*qwen3_tokenizer.encode("hi"), IM_END_ID, THINK_START_ID, *qwen3_tokenizer.encode(" there")]
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


def _ends_inside_character(tokenizer: Any, ids: list[int], skip: bool) -> bool:
    """Whether the bytes after the last visible added token end in an incomplete UTF-8
    character (the bytes read from the tokenizer's own vocabulary strings)."""
    from engine.qwen3.vocab import byte_to_unicode

    to_byte = {char: byte for byte, char in enumerate(byte_to_unicode())}
    added = tokenizer.added_tokens_decoder
    tail = b""
    for token_id in ids:
        if token_id in added:
            if not (skip and added[token_id].special):
                tail = b""
            continue
        piece = tokenizer.convert_ids_to_tokens(token_id)
        tail += bytes(to_byte[ch] for ch in piece) if piece is not None else b""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(tail)
    return bool(decoder.getstate()[0])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_one_shot_decode(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, data: Any, skip: bool) -> None:
    """Any id sequence — byte tokens split anywhere, specials, markers — decodes like the tokenizer,
    except that an output ending inside a character drops that character and the text held
    with it: then the stream is a prefix of the full decode, whose rest ends in U+FFFD."""
    sample_ids = qwen3_tokenizer.encode(SAMPLE)
    ids = data.draw(
        st.lists(
            st.one_of(st.sampled_from(sample_ids), _INTERESTING, st.integers(0, qwen3_vocab.size - 1)),
            max_size=40,
        )
    )
    streamed = "".join(decode_stream(qwen3_vocab, ids, skip=skip))
    full = qwen3_tokenizer.decode(ids, skip_special_tokens=skip)
    if not _ends_inside_character(qwen3_tokenizer, ids, skip):
        assert streamed == full
        return
    assert full.startswith(streamed)
    assert full[len(streamed) :].endswith("\ufffd")


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


def _byte_level_tokenizer() -> Any:
    """A tiny byte-level BPE (one token per byte), built in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.qwen3.vocab import byte_to_unicode

    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(byte_to_unicode())}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_vocabularies_are_not_kept_past_the_bounded_cache() -> None:
    """A tokenizer nobody holds is freed once `vocab_for` has moved past it: neither the
    vocabulary cache nor a detokenizer's table keeps it (issue #27)."""
    import gc
    import weakref

    from derender.vocab import VOCAB_CACHE_SIZE

    tokenizer = _byte_level_tokenizer()
    vocab = vocab_for(tokenizer)
    assert vocab_for(tokenizer) is vocab
    detok = make_detokenizer(vocab)
    assert "".join(detok.step(i) for i in tokenizer.encode("héllo").ids) == "héllo"
    gone = weakref.ref(tokenizer)
    del tokenizer, vocab, detok
    others = [_byte_level_tokenizer() for _ in range(VOCAB_CACHE_SIZE)]
    for other in others:
        vocab_for(other)
    gc.collect()
    assert gone() is None


def test_complete_text_table_is_built_once_per_vocabulary(qwen3_vocab: TokenVocab) -> None:
    assert qwen3_vocab.complete_text() is qwen3_vocab.complete_text()
    assert make_detokenizer(qwen3_vocab)._text is qwen3_vocab.complete_text()  # type: ignore[attr-defined]


def test_window_detokenizer_drops_a_character_cut_by_the_end() -> None:
    tokenizer = _metaspace_tokenizer()
    vocab = vocab_for(tokenizer)
    euro = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    ids = [2, 3, 4, *euro[:2]]
    assert tokenizer.decode(ids).endswith("\ufffd")
    detok = make_detokenizer(vocab)
    assert "".join([detok.step(i) for i in ids] + [detok.finish()]) == "hello world"
