"""exllamav3 side by side with the kit's kernels, through the GPU tests' wrapper (tests/gpu/exllamav3_ref.py).

The wrapper asks to be imported as `exllamav3_ref` with tests/gpu on sys.path, so that the tests and
the benches share one module object (and one build of exllamav3's extension); this is the one place a
bench extends sys.path.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

from bench.lib.meta import KIT_ROOT

TESTS_GPU = KIT_ROOT / "tests" / "gpu"


def exllamav3_reference() -> ModuleType:
    """The `exllamav3_ref` module (importing it does not build exllamav3; its import_exllamav3() does)."""
    if str(TESTS_GPU) not in sys.path:
        sys.path.insert(0, str(TESTS_GPU))
    return importlib.import_module("exllamav3_ref")
