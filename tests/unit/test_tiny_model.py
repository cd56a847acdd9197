"""The tiny random Qwen3 model loads with transformers and runs a forward pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")


def test_config_is_tiny_qwen3(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["head_dim"] >= 32
    assert config["vocab_size"] == 151_936
    assert config["tie_word_embeddings"] is True


def test_folder_carries_tokenizer_and_stop_ids(tiny_model_dir: Path, qwen3_tokenizer_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tiny_model_dir / name).read_bytes() == (qwen3_tokenizer_dir / name).read_bytes()
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_forward_pass_over_rendered_prompt(tiny_model_dir: Path, qwen3_tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.head_dim >= 32
    prompt = qwen3_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([qwen3_tokenizer.encode(prompt)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 151_936)
    assert torch.isfinite(logits).all()
