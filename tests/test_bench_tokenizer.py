"""bench.lib.checkpoints.add_tokenizer: a stand-in checkpoint at a larger vocabulary than the tiny one gets
the tiny tokenizer padded to its vocab_size, so a lane's front decodes every id the model can emit and
renders GLM's chat markup, and config.json's special ids are the tokenizer's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lib.checkpoints import add_tokenizer
from glm53.serving.front.chat import ChatText
from glm53.synthetic.tiny_tokenizer import EOS_TOKENS, VOCAB_SIZE, special_id


def _config(folder: Path, vocab: int) -> Path:
    (folder / "config.json").write_text(json.dumps({"vocab_size": vocab, "eos_token_id": [1], "bos_token_id": 0}))
    return folder


def test_the_tokenizer_covers_the_vocab_and_renders_the_chat(tmp_path: Path) -> None:
    add_tokenizer(_config(tmp_path, 4096))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["vocab_size"] == 4096 and cfg["eos_token_id"] == [special_id(t) for t in EOS_TOKENS]
    assert cfg["bos_token_id"] == special_id("[gMASK]") and cfg["pad_token_id"] == special_id("<|endoftext|>")
    text = ChatText(tmp_path)
    assert text.tokenizer.get_vocab_size(with_added_tokens=True) == 4096
    assert text.decode([VOCAB_SIZE, 4095]) == f"<|reserved_{VOCAB_SIZE}|><|reserved_4095|>"
    ids = text.encode(text.render([{"role": "user", "content": "hello"}]))
    assert ids[:2] == [special_id("[gMASK]"), special_id("<sop>")] and max(ids) < VOCAB_SIZE
    assert text.encode("<|reserved_4000|>") == [4000]  # a reply's text read back is the same ids


def test_a_vocab_below_the_tiny_tokenizers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="more than the checkpoint's vocab_size 1024"):
        add_tokenizer(_config(tmp_path, 1024))
