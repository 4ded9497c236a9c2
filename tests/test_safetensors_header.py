"""safetensors header validation on real files: written by the safetensors library, then damaged."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glm53.formats.safetensors_header import MAX_HEADER_BYTES, ShardError, read_header


def _good(path: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "model.layers.0.self_attn.q_a_proj.weight": torch.randn(32, 16, dtype=torch.bfloat16),
        "model.layers.0.mlp.experts.0.gate_proj.trellis": torch.randint(-2**15, 2**15, (1, 2, 48), dtype=torch.int16),
        "model.layers.0.mlp.experts.0.gate_proj.mcg": torch.tensor(-877912083, dtype=torch.int32),
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(8),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def _rewrite(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _parts(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def test_good_file_matches_what_safetensors_wrote(tmp_path: Path) -> None:
    path = tmp_path / "good.safetensors"
    tensors = _good(path)
    header = read_header(path)
    assert set(header.tensors) == set(tensors)
    assert header.metadata == {"format": "pt"}
    assert header.file_size == path.stat().st_size == 8 + header.header_len + header.data_bytes
    for name, t in tensors.items():
        info = header.tensors[name]
        assert info.shape == tuple(t.shape)
        assert info.nbytes == t.numel() * t.element_size()
        with open(path, "rb") as f:  # the span really holds this tensor's bytes
            f.seek(header.data_offset + info.begin)
            assert f.read(info.nbytes) == t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    assert header.tensors["model.layers.0.mlp.experts.0.gate_proj.mcg"].shape == ()


def test_missing_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ShardError) as err:
        read_header(tmp_path / "absent.safetensors")
    assert err.value.kind == "missing" and "absent.safetensors" in str(err.value)
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(ShardError) as err:
        read_header(tmp_path / "dir.safetensors")
    assert err.value.kind == "unreadable" and "directory" in str(err.value)


def test_fifo_is_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)  # opening it for reading would block forever; the check must not open it
    with pytest.raises(ShardError) as err:
        read_header(fifo)
    assert err.value.kind == "unreadable"


def test_lfs_pointer_named_with_real_size(tmp_path: Path) -> None:
    path = tmp_path / "model-00001-of-00002.safetensors"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 5368709120\n")
    with pytest.raises(ShardError) as err:
        read_header(path)
    assert err.value.kind == "lfs_pointer"
    assert "5,368,709,120 bytes" in str(err.value) and "git lfs pull" in str(err.value)
    with pytest.raises(ShardError) as err:  # the manifest's size wins when known
        read_header(path, expected_size=123456789)
    assert "123,456,789 bytes" in str(err.value)


def test_truncated(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    _good(path)
    size = path.stat().st_size
    os.truncate(path, size - 10)
    with pytest.raises(ShardError) as err:
        read_header(path)
    assert err.value.kind == "truncated" and "10 missing" in str(err.value)


def test_trailing_bytes_and_size_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    _good(path)
    size = path.stat().st_size
    with pytest.raises(ShardError) as err:
        read_header(path, expected_size=size + 1)
    assert err.value.kind == "size_mismatch"
    with open(path, "ab") as f:
        f.write(b"\0" * 3)
    with pytest.raises(ShardError) as err:
        read_header(path)
    assert err.value.kind == "trailing_bytes"


def test_header_length_past_end_and_over_cap(tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", 5000) + b"{}")
    with pytest.raises(ShardError) as err:
        read_header(path)
    assert err.value.kind == "header_length" and "past the end" in str(err.value)
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(ShardError) as err:
        read_header(path)
    assert err.value.kind == "header_length" and "cap" in str(err.value)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ShardError) as err:
        read_header(path)
    assert err.value.kind == "too_short"


def test_header_not_json(tmp_path: Path) -> None:
    path = tmp_path / "j.safetensors"
    raw = b'{"a": [1, 2'
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ShardError) as err:
        read_header(path)
    assert err.value.kind == "header_json"
    raw = b"[1, 2, 3]"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ShardError) as err:
        read_header(path)
    assert err.value.kind == "header_json"


def test_overlap_hole_dtype_and_span(tmp_path: Path) -> None:
    path = tmp_path / "o.safetensors"
    _good(path)
    header, data = _parts(path)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    cases = []
    h = json.loads(json.dumps(header))  # overlap: second tensor starts 2 bytes early, last one shifted too
    b0, e0 = h[names[1]]["data_offsets"]
    h[names[1]]["data_offsets"] = [b0 - 2, e0 - 2]
    cases.append(("overlap", h))
    h = json.loads(json.dumps(header))  # hole: first tensor starts at 2
    h[names[0]]["data_offsets"][0] += 2
    h[names[0]]["shape"] = None
    cases.append(("header_schema", h))
    h = json.loads(json.dumps(header))
    h[names[0]]["dtype"] = "Q4_K"
    cases.append(("dtype", h))
    h = json.loads(json.dumps(header))
    h["model.layers.0.self_attn.q_a_proj.weight"]["shape"] = [32, 17]
    cases.append(("shape_span", h))
    h = json.loads(json.dumps(header))  # hole: drop a middle tensor
    del h[names[1]]
    cases.append(("hole", h))
    for kind, bad in cases:
        _rewrite(path, bad, data)
        with pytest.raises(ShardError) as err:
            read_header(path)
        assert err.value.kind == kind, (kind, str(err.value))
        assert str(path) in str(err.value)
