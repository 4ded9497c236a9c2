"""Session fixtures over one generated tiny GLM-5.3 checkpoint (and its transformers twin).

Import the fixtures you use into your test module:

    from tests.fixtures_tiny import tiny_dirs, tiny_engine   # noqa: F401

`tiny_dirs` -> TinyDirs(model=<EXL3 tiny checkpoint>, reference=<decoded transformers twin>), written by
glm53.synthetic.tiny.write_tiny_checkpoint (seed 0) into pytest's cache folder under a name that hashes the writer's
sources (glm53/tiny*.py, glm53/exl3/*.py, glm53/formats/exl3_storage.py, glm53/formats/checkpoint_rules.py, glm53/config.py)
and the torch version, so it is regenerated whenever they change (and once per fresh checkout, as in CI);
GLM53_TINY_FRESH=1 forces a rewrite. `tiny_exl3_all_dirs`: the same for the variant with every linear that
may be EXL3 stored so (write_tiny_checkpoint(exl3_all=True)). `tiny_engine` -> a Glm53Engine on it, CPU, fp32
compute, fp32 latent cache, prefill grid 32 (so prompts span several chunks); shared: tests that change
its settings must restore them (use `fresh_engine_state`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import hashlib
import os
import shutil

import pytest

TINY_CHUNK = 32


@dataclass(frozen=True)
class TinyDirs:
    model: Path
    reference: Path


def _writer_key() -> str:
    import torch

    import glm53

    pkg = Path(glm53.__file__).parent
    sources = sorted([*pkg.glob("synthetic/tiny*.py"), *pkg.glob("exl3/*.py"), pkg / "formats" / "exl3_storage.py",
                      pkg / "formats" / "checkpoint_rules.py", pkg / "config.py"])
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, stem: str,
             exl3_all: bool) -> TinyDirs:
    from glm53.synthetic.tiny import write_tiny_checkpoint

    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider: write per session
    name = f"{stem}_{_writer_key()}"
    root = Path(cache.mkdir(name)) if cache is not None else tmp_path_factory.mktemp(name)
    model, reference = root / "model", root / "reference"
    complete = (model / "config.json").exists() and (reference / "config.json").exists()
    if not complete or os.environ.get("GLM53_TINY_FRESH") == "1":
        shutil.rmtree(model, ignore_errors=True)
        shutil.rmtree(reference, ignore_errors=True)
        write_tiny_checkpoint(model, seed=0, reference_dir=reference, exl3_all=exl3_all)  # each folder appears by rename
    return TinyDirs(model, reference)


@pytest.fixture(scope="session")
def tiny_dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyDirs:
    return _written(request, tmp_path_factory, "glm53_tiny", exl3_all=False)


@pytest.fixture(scope="session")
def tiny_exl3_all_dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyDirs:
    return _written(request, tmp_path_factory, "glm53_tiny_exl3_all", exl3_all=True)


@pytest.fixture(scope="session")
def tiny_engine(tiny_dirs: TinyDirs):
    from glm53.runtime.engine import Glm53Engine

    return Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=TINY_CHUNK,
                       cache_block=TINY_CHUNK)


@contextmanager
def fresh_engine_state(engine, **settings) -> Iterator:
    """Run with a cleared conversation and temporary attribute settings, restored afterwards."""
    saved = {name: getattr(engine, name) for name in settings}
    saved_state, saved_trace = engine.state, engine.trace
    engine.state, engine.trace = None, None
    for name, value in settings.items():
        setattr(engine, name, value)
    try:
        yield engine
    finally:
        for name, value in saved.items():
            setattr(engine, name, value)
        engine.state, engine.trace = saved_state, saved_trace
