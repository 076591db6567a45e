"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

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


@pytest.fixture
def one_thread():
    """One torch thread: the tiny models gain nothing from more, and on a shared 2-core
    machine an oversubscribed pool made TRL and benchmark runs 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
