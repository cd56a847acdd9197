"""gpt-oss (Harmony) test tokenizers: Qwen3's BPE plus Harmony's specials, and the real o200k_harmony.

Two folders, for two jobs:

``harmony_tokenizer`` (unit tests, no vLLM needed) is the offline Qwen3
tokenizer (``tests.support.family_tokenizers``) with Harmony's seven marker
tokens added as *special* tokens, as they are in gpt-oss's o200k_harmony
vocabulary (so ``skip_special_tokens`` removes their text, as with gpt-oss).
What differs from gpt-oss's tokenizer:
- the BPE is Qwen's, so text splits into other pieces and every id differs
  (markers from 151,669 up); look ids up by token, never hard-code one;
- only the seven markers are added (no ``<|startoftext|>``, reserved tokens);
  Qwen3's own added tokens stay;
- the EOS is ``<|return|>`` alone (gpt-oss also stops on ``<|call|>`` and
  ``<|endoftext|>``);
- the chat template is a minimal one written here (`CHAT_TEMPLATE`), not
  gpt-oss's: messages as ``<|start|>role<|message|>…<|end|>``, the generation
  turn opened with ``<|start|>assistant``.

``o200k_harmony_tokenizer`` (vLLM parity) has gpt-oss's real vocabulary.
vLLM's Harmony parser reads token ids with ``openai_harmony``'s own o200k
encoding, not the model tokenizer, so parity needs a tokenizer whose ids are
o200k_harmony's. The ``oss-harmony`` wheel vLLM 0.32 depends on embeds that
vocabulary (``load_harmony_encoding(HARMONY_GPT_OSS)`` works offline, with no
tiktoken cache or ``TIKTOKEN_ENCODINGS_BASE``), so its ranks and specials are
dumped with vLLM's python and rebuilt here as a ``tokenizers`` BPE: merges
recovered from the ranks (``engine.qwen3.vocab``), o200k's split pattern,
byte level, the 1,091 specials at their ids (199,998-201,088). It encodes
exactly as the Harmony encoding does. Beyond the vocabulary only the EOS
rules follow gpt-oss (``<|return|>`` is the EOS; the generation config stops
on ``<|return|>``, ``<|endoftext|>``, ``<|call|>``); the chat template is
`CHAT_TEMPLATE`. Building takes ~10 s once per cache.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from engine.qwen3.fixtures import TOKENIZER_FILES, _ensure, cache_dir
from engine.qwen3.vocab import build_vocab, derive_merges, load_ranks
from tests.support.family_tokenizers import build_family_tokenizer

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
O200K_VERSION = 1
O200K_DIRNAME = f"o200k-harmony-tokenizer-v{O200K_VERSION}"
DUMP_TIMEOUT_S = 120.0
# o200k's pre-tokenisation split, one alternative per line.
O200K_PATTERN = "|".join(
    (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)
GPT_OSS_EOS = "<|return|>"
GPT_OSS_STOP_IDS = (200002, 199999, 200012)  # <|return|>, <|endoftext|>, <|call|>
# Run with vLLM's python: the ranks (tiktoken file) and the specials (JSON) of o200k_harmony.
_DUMP = """
import base64, json, sys
from openai_harmony import HarmonyEncodingName, load_harmony_encoding
enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
specials = {t: enc.encode(t, allowed_special="all") for t in enc.special_tokens_set}
assert all(len(ids) == 1 for ids in specials.values())
specials = {t: ids[0] for t, ids in specials.items()}
with open(sys.argv[1], "w", encoding="ascii") as out:
    for i in range(min(specials.values())):
        out.write(base64.b64encode(bytes(enc._inner.decode_bytes([i]))).decode() + f" {i}\\n")
with open(sys.argv[2], "w", encoding="utf-8") as out:
    json.dump(specials, out)
"""


def harmony_tokenizer(root: Path | None = None) -> Path:
    """The unit tests' folder: Qwen3 plus Harmony's markers as specials, EOS `<|return|>`."""
    return build_family_tokenizer(
        root or cache_dir(),
        "harmony",
        [(marker, True) for marker in MARKERS],
        chat_template=CHAT_TEMPLATE,
        eos=GPT_OSS_EOS,
    )


def o200k_harmony_tokenizer(vllm_python: str, root: Path | None = None) -> Path:
    """gpt-oss's o200k_harmony vocabulary as a tokenizer folder (built once, with vLLM's python)."""
    target = (root or cache_dir()) / O200K_DIRNAME
    return _ensure(target, TOKENIZER_FILES, lambda out: _write_o200k(out, vllm_python))


def _write_o200k(out: Path, vllm_python: str) -> None:
    with tempfile.TemporaryDirectory(prefix="onehop-o200k-") as tmp:
        ranks_path, specials_path = Path(tmp) / "o200k.tiktoken", Path(tmp) / "specials.json"
        subprocess.run(
            [vllm_python, "-c", _DUMP, str(ranks_path), str(specials_path)],
            check=True,
            timeout=DUMP_TIMEOUT_S,
            capture_output=True,
        )
        ranks = load_ranks(ranks_path)
        specials: dict[str, int] = json.loads(specials_path.read_text(encoding="utf-8"))
    ordered = sorted(specials.items(), key=lambda item: item[1])
    tokenizer = _o200k_bpe(ranks)
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in ordered])
    for text, token_id in ordered:
        if tokenizer.token_to_id(text) != token_id:
            raise ValueError(f"{text} landed on {tokenizer.token_to_id(text)}, o200k_harmony has {token_id}")
    tokenizer.save(str(out / "tokenizer.json"))
    decoder = {str(token_id): _entry(text) for text, token_id in ordered}
    _write_json(out / "tokenizer_config.json", _o200k_config(decoder))
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": "<|startoftext|>", "eos_token": GPT_OSS_EOS, "pad_token": "<|endoftext|>"},
    )
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": specials["<|startoftext|>"], "eos_token_id": list(GPT_OSS_STOP_IDS), "pad_token_id": 199999},
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _o200k_bpe(ranks: dict[bytes, int]) -> Tokenizer:
    model = BPE(
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
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _o200k_config(decoder: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": "<|startoftext|>",
        "eos_token": GPT_OSS_EOS,
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131_072,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def _entry(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
