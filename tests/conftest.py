"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import uuid

import pytest

from routing_replay.store.segment import segment_path

SLOW_KINDS = ("ray", "compile", "stress", "distributed")  # each of these is slow as well


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def name(request):
    """A unique store name for one test; its segment is removed afterwards if still there."""
    n = f"test-{request.module.__name__.removeprefix('test_')}-{uuid.uuid4().hex[:10]}"
    yield n
    if os.path.exists(segment_path(n)):
        os.unlink(segment_path(n))
