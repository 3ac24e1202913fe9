"""Shared pytest set-up for the ampfused tests: the ``device`` fixture and the opt-in markers.

- ``device``: every test that takes it runs once on ``"cpu"`` and once on ``"cuda"``; the CUDA
  run carries ``pytest.mark.cuda`` (select or deselect it with ``-m cuda`` / ``-m "not cuda"``).
- ``@pytest.mark.cuda``: skipped when ``torch.cuda.is_available()`` is False.
- ``@pytest.mark.bigmem``: allocates several GB; skipped unless a GPU is present or the
  environment sets ``AMPFUSED_BIGMEM=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA: bool = torch.cuda.is_available()
BIGMEM: bool = os.environ.get("AMPFUSED_BIGMEM") == "1" or HAS_CUDA

_SKIP_CUDA = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
_SKIP_BIGMEM = pytest.mark.skip(
    reason="allocates several GB: runs with a GPU present or with AMPFUSED_BIGMEM=1"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # One place decides the skips, so a marker on a test, a class or a fixture param all work.
    for item in items:
        if not HAS_CUDA and item.get_closest_marker("cuda") is not None:
            item.add_marker(_SKIP_CUDA)
        if not BIGMEM and item.get_closest_marker("bigmem") is not None:
            item.add_marker(_SKIP_BIGMEM)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    """The device a test runs on, as a string ("cpu" or "cuda")."""
    return request.param
