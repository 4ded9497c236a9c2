"""The checkpoint verifier on real files: a good synthetic GLM-5.3 checkpoint, then each damage.

Every case runs the real CLI (bash fetch_weights.sh --offline --dir ...) and checks the exit code,
the shard named on stderr with a remedy, a complete JSON report, and that nothing was left
half-written (no temp files, the checkpoint folder untouched).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from glm53.config import Glm53Config
from glm53.layout.plan import plan_layout
from glm53.checkpoints.manifest import FileRecord, Manifest, save_manifest
from glm53.synthetic.checkpoints import default_expert_bits, glm53_tensor_specs, tiny_config, write_checkpoint
from glm53.checkpoints.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("pristine"), tiny_config(), n_shards=3, seed=1)


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def run_cli(model_dir: Path, *extra: str, report: Path | None = None) -> tuple[int, str, str, dict | None]:
    report = report or model_dir.parent / "report" / "r.json"
    report.parent.mkdir(exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(model_dir.parent / "hf_home"))
    proc = subprocess.run(["bash", str(ROOT / "fetch_weights.sh"), "--offline", "--dir", str(model_dir), "--json", str(report), *extra],
                          capture_output=True, text=True, timeout=120, env=env)
    leftovers = [p.name for p in report.parent.iterdir() if p.name != report.name]
    assert not leftovers, f"temp files left beside the report: {leftovers}"
    doc = json.loads(report.read_text()) if report.exists() else None
    if doc is not None:
        assert doc["exit_code"] == proc.returncode
    return proc.returncode, proc.stdout, proc.stderr, doc


def listing(folder: Path) -> dict[str, tuple[int, float]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime) for p in folder.iterdir() if p.is_file()}


def shard_header(path: Path) -> tuple[dict, int]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), n


def rewrite_header(path: Path, header: dict) -> None:
    """Replace the header, keeping the data buffer (the header length may change)."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


def test_good_checkpoint_summary(ckpt: Path) -> None:
    before = listing(ckpt)
    code, out, err, doc = run_cli(ckpt)
    assert code == 0, err
    assert "OK: complete and valid" in out
    assert listing(ckpt) == before
    s = doc["summary"]
    cfg = Glm53Config.from_dict(tiny_config())
    assert s["model"]["layers"] == 4 and s["model"]["moe_layers"] == 3 and s["model"]["mtp_layers"] == 1
    want: dict[str, Counter] = {p: Counter() for p in ("gate_proj", "up_proj", "down_proj")}
    for layer in range(1, 5):  # MoE layers 1..3 and the MTP layer 4
        for e in range(cfg.n_routed_experts):
            for p in want:
                want[p][str(int(default_expert_bits(layer, e, p)))] += 1
    assert {p: Counter(h) for p, h in s["exl3"]["routed_expert_width_histogram"].items()} == want
    assert s["exl3"]["codebooks"] == {"mcg": s["exl3"]["linears"]}
    for ranks in ("3", "4"):
        assert s["bytes_per_rank"][ranks] == plan_layout(ckpt, int(ranks)).bytes_per_rank()
    assert s["file_bytes"] == sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert doc["findings"] == []


def _expect(ckpt: Path, kind: str, shard: str, code: int = 1) -> tuple[str, dict]:
    before = listing(ckpt)
    rc, out, err, doc = run_cli(ckpt)
    assert rc == code, (out, err)
    assert shard in err and "error:" in err
    kinds = {f["kind"] for f in doc["findings"] if f["level"] in ("error", "model")}
    assert kind in kinds, doc["findings"]
    assert listing(ckpt) == before  # verification never writes into the checkpoint
    return err, doc


def test_truncated_shard(ckpt: Path) -> None:
    path = ckpt / SHARD2
    os.truncate(path, path.stat().st_size - 4096)
    err, _ = _expect(ckpt, "truncated", SHARD2)
    assert "4,096 missing" in err and "fetch_weights.sh" in err


def test_lfs_pointer_with_manifest_size(ckpt: Path) -> None:
    real = (ckpt / SHARD1).stat().st_size
    save_manifest(ckpt, Manifest("r/x", "main", "c" * 40, "http://x", {SHARD1: FileRecord(real, "ab" * 32)}))
    (ckpt / SHARD1).write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'ab' * 32}\nsize {real}\n")
    err, _ = _expect(ckpt, "lfs_pointer", SHARD1)
    assert "Git LFS pointer" in err and f"{real:,} bytes" in err and "git lfs pull" in err


def test_missing_shard(ckpt: Path) -> None:
    (ckpt / SHARD2).unlink()
    err, _ = _expect(ckpt, "missing", SHARD2)
    assert "is missing" in err


def test_header_length_past_end(ckpt: Path) -> None:
    path = ckpt / SHARD1
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", path.stat().st_size))  # longer than the file itself
    _expect(ckpt, "header_length", SHARD1)


def test_header_not_json(ckpt: Path) -> None:
    path = ckpt / SHARD1
    _, n = shard_header(path)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"{not json")
    _expect(ckpt, "header_json", SHARD1)


def test_overlapping_spans(ckpt: Path) -> None:
    path = ckpt / SHARD2
    header, _ = shard_header(path)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    # two same-sized tensors: point the second at the first one's bytes (sizes stay consistent)
    a, b = next((x, y) for x, y in zip(names, names[1:])
                if header[x]["shape"] == header[y]["shape"] and header[x]["dtype"] == header[y]["dtype"])
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    rewrite_header(path, header)
    err, _ = _expect(ckpt, "overlap", SHARD2)
    assert a in err and b in err


def test_dtype_shape_mismatch(ckpt: Path) -> None:
    path = ckpt / SHARD2
    header, _ = shard_header(path)
    name = next(k for k in header if k.endswith(".trellis"))
    header[name]["dtype"] = "F32"  # same shape, twice the bytes the span holds
    rewrite_header(path, header)
    err, _ = _expect(ckpt, "shape_span", SHARD2)
    assert name in err


def test_index_names_tensor_absent_from_its_shard(ckpt: Path) -> None:
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = next(n for n, s in index["weight_map"].items() if s == SHARD1)
    index["weight_map"][victim] = SHARD2  # the index now says SHARD2 holds it
    index_path.write_text(json.dumps(index))
    err, _ = _expect(ckpt, "tensor_absent", SHARD2)
    assert victim in err and f"found in {SHARD1}" in err


def test_directory_in_place_of_shard(ckpt: Path) -> None:
    (ckpt / SHARD2).unlink()
    (ckpt / SHARD2).mkdir()  # tests run as root, so chmod 000 would not stop a read
    err, _ = _expect(ckpt, "unreadable", SHARD2)
    assert "directory" in err


def test_fifo_in_place_of_shard_does_not_hang(ckpt: Path) -> None:
    (ckpt / SHARD1).unlink()
    os.mkfifo(ckpt / SHARD1)
    _expect(ckpt, "unreadable", SHARD1)


def test_model_level_missing_layer(tmp_path: Path) -> None:
    raw = tiny_config()
    specs = [s for s in glm53_tensor_specs(Glm53Config.from_dict(raw)) if not s.name.startswith("model.layers.2.mlp.experts.1.")]
    ckpt = write_checkpoint(tmp_path / "m", raw, n_shards=2, specs=specs)
    rc, out, err, doc = run_cli(ckpt)
    assert rc == 3, (out, err)
    assert "layer 2" in err and "model.layers.2.mlp.experts.1.gate_proj" in err
    assert doc["status"] == "model_errors"


def test_unknown_shard_and_tensor_are_warnings(ckpt: Path) -> None:
    shutil.copy(ckpt / SHARD1, ckpt / "extra.safetensors")
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = next(n for n in index["weight_map"] if n.endswith("shared_head.head.weight"))  # MTP's own head: optional
    del index["weight_map"][dropped]
    index_path.write_text(json.dumps(index))
    rc, out, err, doc = run_cli(ckpt)
    assert rc == 0, err
    kinds = {f["kind"] for f in doc["findings"]}
    assert {"unknown_shard", "unknown_tensor"} <= kinds
    assert "extra.safetensors" in out and dropped in out


def _manifest_for(ckpt: Path) -> None:
    files = {}
    for p in ckpt.iterdir():
        if p.is_file():
            files[p.name] = FileRecord(p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest() if p.suffix == ".safetensors" else None)
    save_manifest(ckpt, Manifest("r/x", "main", "c" * 40, "http://x", files))


def test_deep_hashes(ckpt: Path) -> None:
    rc, _, err, doc = run_cli(ckpt, "--deep")
    assert rc == 1 and "no_hashes" in {f["kind"] for f in doc["findings"]} and "online" in err
    _manifest_for(ckpt)
    rc, out, err, doc = run_cli(ckpt, "--deep", "--workers", "3")
    assert rc == 0, err
    assert doc["deep"]["checked"] == 3 and doc["deep"]["mismatches"] == 0
    path = ckpt / SHARD2  # flip one data byte: same size, valid header, wrong content
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 100)
        byte = f.read(1)
        f.seek(size - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, out, err, doc = run_cli(ckpt)
    assert rc == 0  # headers alone cannot see it
    rc, out, err, doc = run_cli(ckpt, "--deep")
    assert rc == 1 and SHARD2 in err and "SHA-256" in err
    assert [f["kind"] for f in doc["findings"]] == ["hash_mismatch"]


def test_manifest_listed_files_and_sizes(ckpt: Path) -> None:
    _manifest_for(ckpt)
    rc, _, err, _ = run_cli(ckpt)
    assert rc == 0, err
    from glm53.checkpoints.manifest import load_manifest

    m = load_manifest(ckpt)
    m.files["tokenizer.json"] = FileRecord(1234)  # the hub lists a file the folder lacks
    m.files[SHARD1] = FileRecord(m.files[SHARD1].size + 8, m.files[SHARD1].sha256)  # and another size
    save_manifest(ckpt, m)
    (ckpt / "config.json").unlink()
    rc, _, err, doc = run_cli(ckpt)
    assert rc == 1
    kinds = {(f["kind"], Path(f["file"]).name) for f in doc["findings"] if f["file"]}
    assert {("missing", "tokenizer.json"), ("size_mismatch", SHARD1), ("config", "config.json")} <= kinds


def test_no_local_copy_offline(tmp_path: Path) -> None:
    rc, out, err, doc = run_cli(tmp_path / "nothing_here")
    assert rc == 4
    assert "no local copy" in err and "fetch_weights.sh" in err
    assert doc["status"] == "no_checkpoint"


def test_report_replaced_atomically(ckpt: Path) -> None:
    report = ckpt.parent / "report" / "r.json"
    report.parent.mkdir()
    report.write_text("old contents")
    rc, _, _, doc = run_cli(ckpt, report=report)
    assert rc == 0 and doc["status"] == "ok"


def test_interrupted_deep_check_stops_promptly_and_writes_nothing(tmp_path: Path) -> None:
    """Ctrl-C during --deep over an 8 GiB shard (sparse: no disk): exit 130 within seconds, no report."""
    import signal
    import time

    from glm53.synthetic.checkpoints import TensorSpec, write_shard

    ckpt = write_checkpoint(tmp_path / "big", tiny_config(), n_shards=2)
    big = TensorSpec("model.layers.0.mlp.unused.weight", "BF16", (65536, 65536))
    write_shard(ckpt / "zz-big.safetensors", [big], sparse=True)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][big.name] = "zz-big.safetensors"
    index_path.write_text(json.dumps(index))
    wrong_hashes = {p.name: FileRecord(p.stat().st_size, "0" * 64) for p in ckpt.glob("*.safetensors")}
    save_manifest(ckpt, Manifest("r/x", "main", "c" * 40, "http://x", wrong_hashes))
    report = tmp_path / "report" / "r.json"
    report.parent.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # A terminal's Ctrl-C reaches a tool whose SIGINT is at its default. The test process cannot promise
    # that for its children: a non-interactive shell starts a background job (`... &`, no job control)
    # with SIGINT ignored (POSIX), pytest then inherits SIG_IGN, and so does every child it forks: the
    # full-suite runs that failed here were started that way, and the child hashed to the end (rc 1
    # after ~25 s). So the child starts from a small launcher that restores the default and unblocks
    # SIGINT, then execs the script as a user's shell would.
    launcher = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); os.execvp(sys.argv[1], sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", launcher, "bash", str(ROOT / "fetch_weights.sh"), "--offline",
                             "--dir", str(ckpt), "--deep", "--json", str(report)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # the first progress line means hashing has begun
        if line.startswith("deep:"):
            break
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    rc = proc.wait(timeout=60)
    elapsed = time.monotonic() - t0
    rest = proc.stderr.read()  # what the tool said after the interrupt: the reason when rc is not 130
    assert rc == 130, f"exit {rc} after {elapsed:.1f} s; stderr after the first progress line:\n{rest[-2000:]}"
    assert elapsed < 10
    assert list(report.parent.iterdir()) == []  # no report, no temp file
