"""One verdict on a checkpoint: `glm53.check()`, the fetch verifier (`python -m glm53.checkpoints --offline`,
run in-process) and the engine's load (`load_weights`) accept and refuse the same checkpoints, and a
refusal names the tensor (and the header judges its shard).

Checkpoints: the tiny checkpoint (routed experts EXL3) and its exl3_all variant (every linear that
may be EXL3 is), and broken copies of each with one bad input (tests/checkpoint_edits.py), put in a
routed expert of the default and in kv_a_proj_with_mqa of exl3_all, whose 80 outputs exllamav3 pads
to 128. The MTP cases break MTP's own linears (the default's last routed expert projection
`experts.0.down_proj`, exl3_all's kv_b_proj, whose 64 inputs are padded) or drop the MTP layer.

What headers cannot show: a codebook marker's value is data. check() and the verifier accept a
wrong one; the loader reads it and refuses (`LOADER_ONLY`, judged at the loader leg alone).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import glm53
from glm53.config import ConfigError
from glm53.exl3.decode import single_threaded
from glm53.checkpoints.__main__ import main as fetch_main
from glm53.loading.loader import CheckpointError, load_weights
from tests.checkpoint_edits import EDITS, broken_copy
from tests.fixtures_tiny import tiny_dirs, tiny_exl3_all_dirs  # noqa: F401

ACCEPT, REFUSE, LOADER_ONLY = "accept", "refuse", "loader only"
REFUSALS = (CheckpointError, ConfigError, ValueError)

# variant -> (the linear most cases break, MTP's linear) ; the router and the MTP layer are the same in both
TARGETS = {
    "default": ("model.layers.1.mlp.experts.0.gate_proj", "model.layers.4.mlp.experts.0.down_proj"),
    "exl3_all": ("model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.4.self_attn.kv_b_proj"),
}
ROUTER, MTP_LAYER = "model.layers.1.mlp.gate", "model.layers.4"

# case -> (edit, which prefix it breaks: linear | mtp | router | mtp_layer, verdict)
CASES: dict[str, tuple[str | None, str, str]] = {
    "pristine": (None, "linear", ACCEPT),
    "packed_signs": ("packed_signs", "linear", ACCEPT),
    "no_mtp_layer": ("no_mtp_layer", "mtp_layer", ACCEPT),
    "k_2.5_without_mul1": ("k_2.5_without_mul1", "linear", REFUSE),
    "k_8": ("k_8", "linear", REFUSE),
    "trellis_in_tiles": ("trellis_in_tiles", "linear", REFUSE),
    "trellis_out_tiles": ("trellis_out_tiles", "linear", REFUSE),
    "trellis_2d": ("trellis_2d", "linear", REFUSE),
    "no_suh_no_su": ("no_suh_no_su", "linear", REFUSE),
    "no_svh": ("no_svh", "linear", REFUSE),
    "suh_length": ("suh_length", "linear", REFUSE),
    "both_markers": ("both_markers", "linear", REFUSE),
    "unknown_part": ("unknown_part", "linear", REFUSE),
    "weight_and_trellis": ("weight_and_trellis", "linear", REFUSE),
    "bias": ("bias", "linear", REFUSE),
    "exl3_router": ("exl3_router", "router", REFUSE),
    "mtp_k_8": ("k_8", "mtp", REFUSE),
    "wrong_marker_value": ("wrong_marker_value", "linear", LOADER_ONLY),
}

def _prefix(variant: str, target: str) -> str:
    linear, mtp = TARGETS[variant]
    return {"linear": linear, "mtp": mtp, "router": ROUTER, "mtp_layer": MTP_LAYER}[target]


@pytest.fixture(scope="module")
def checkpoints(tiny_dirs, tiny_exl3_all_dirs, tmp_path_factory):  # noqa: F811
    """(variant, case) -> the checkpoint folder, built on first use."""
    sources = {"default": tiny_dirs.model, "exl3_all": tiny_exl3_all_dirs.model}
    root = tmp_path_factory.mktemp("verdict")
    built: dict[tuple[str, str], Path] = {}

    def get(variant: str, case: str) -> Path:
        edit, target, _ = CASES[case]
        if edit is None:
            return sources[variant]
        if (variant, case) not in built:
            built[variant, case] = broken_copy(sources[variant], root / f"{variant}-{case}",
                                               _prefix(variant, target), EDITS[edit].change)
        return built[variant, case]

    return get


def _named(variant: str, case: str) -> str:
    edit, target, _ = CASES[case]
    return EDITS[edit].names.format(p=_prefix(variant, target)) if edit else ""


def _params(engine: bool) -> list:
    out = []
    for variant in TARGETS:
        for case in CASES:
            out.append(pytest.param(variant, case, id=f"{variant}-{case}"))
    return out


def _fetch_verdict(folder: Path, report: Path) -> tuple[int, str]:
    result = CliRunner().invoke(fetch_main, ["--offline", "--dir", str(folder), "--json", str(report)],
                                env={"HF_HUB_OFFLINE": "1"})
    doc = json.loads(report.read_text())
    errors = [f"{f['file'] or ''}: {f['message']}" for f in doc["findings"] if f["level"] in ("error", "model")]
    return result.exit_code, "\n".join(errors)


@pytest.mark.parametrize("variant, case", _params(engine=False))
def test_check_and_fetch_verifier_agree(checkpoints, variant: str, case: str, tmp_path: Path) -> None:
    folder = checkpoints(variant, case)
    verdict = CASES[case][2]
    code, errors = _fetch_verdict(folder, tmp_path / "report.json")
    if verdict in (ACCEPT, LOADER_ONLY):
        assert glm53.check(folder) is None
        assert code == 0, errors
        return
    with pytest.raises(REFUSALS) as refused:
        glm53.check(folder)
    assert code == 3, errors  # model level: the files are sound
    name = _named(variant, case)
    for said in (str(refused.value), errors):
        assert name in said and ".safetensors" in said, said


def _load(folder: Path):  # noqa: ANN202
    with single_threaded():  # the decode of the tiny's experts: 6x faster on one thread when the host is busy
        return load_weights(folder, device="cpu", progress=lambda _: None)


@pytest.mark.parametrize("variant, case", _params(engine=True))
def test_engine_load_agrees(checkpoints, variant: str, case: str) -> None:
    folder = checkpoints(variant, case)
    if CASES[case][2] == ACCEPT:
        weights = _load(folder)
        assert (weights.mtp is None) == (case == "no_mtp_layer")  # an EXL3 eh_proj still brings MTP
        return
    with pytest.raises(REFUSALS) as refused:
        _load(folder)
    module = _prefix(variant, CASES[case][1])  # the loader may name the part it read first (suh for a trellis' in tiles)
    assert module in str(refused.value), refused.value
