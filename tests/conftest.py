"""Shared pytest wiring: the `gpu` marker skips (with its reason) where CUDA is absent; torch runs one
intra-op thread in the test process (`host_threads` gives the count it had, for the tests whose point
is a result that does not depend on the thread count)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

_HOST_THREADS: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    """The suite's tensors are tiny: a second OpenMP thread saves nothing on them, and on a shared
    2-core host every parallel region waits for a thread that another process holds off its core
    (the forward tests of tests/test_reference_fidelity.py ran 10-20x slower with two threads on a
    loaded host). Set before collection, which imports the kit."""
    config.addinivalue_line("markers", "host_threads: torch at the host's thread count, not the suite's one")
    try:
        import torch
    except ImportError:
        return
    if not _HOST_THREADS:
        _HOST_THREADS.append(torch.get_num_threads())
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def host_threads() -> int:
    """torch's intra-op thread count before pytest_configure set one (OMP_NUM_THREADS or the cores)."""
    return _HOST_THREADS[0] if _HOST_THREADS else 1


@pytest.fixture(autouse=True)
def _host_threads_where_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked `host_threads` run at the host's thread count: their tolerances were fitted to
    the sums MKL makes with it (a sum split over threads rounds differently)."""
    if request.node.get_closest_marker("host_threads") is None:
        yield
        return
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(request.getfixturevalue("host_threads"))
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="gpu: no CUDA device here; run on the lent H200 (see bench/results/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
