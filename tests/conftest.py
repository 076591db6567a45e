"""Fixtures shared by the test modules."""

from __future__ import annotations

import gc
import os
import re
import uuid

import pytest
import torch

from routing_replay.store.segment import segment_path

SLOW_KINDS = ("ray", "compile", "stress", "distributed")  # each of these is slow as well


WHOLE_MODULE_SLOW = re.compile(rf"^pytestmark = pytest\.mark\.(slow|{'|'.join(SLOW_KINDS)})$", re.M)


def pytest_ignore_collect(collection_path, config):
    """The fast tier (`-m "not slow"`) does not import the modules marked slow as a whole:
    importing them alone (TRL, Ray Train, the benchmarks) costs it seconds."""
    if config.getoption("markexpr") != "not slow" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix == ".py" and WHOLE_MODULE_SLOW.search(collection_path.read_text()):
        return True
    return None


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
def no_gc():
    """No garbage collection during the test: what a stopped or dropped handle leaves must go
    by reference counting alone (a reference cycle would keep it until a later collection,
    which a test's own collection would hide)."""
    gc.disable()  # (what earlier tests left stays as it is: the tests compare before/after)
    yield
    gc.enable()


@pytest.fixture
def one_thread():
    """One torch thread: the tiny models gain nothing from more, and on a shared 2-core
    machine an oversubscribed pool made TRL and benchmark runs 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
