"""StoreOptions: one value for how a node's store is made, from node_store to the actor."""

from __future__ import annotations

import numpy as np
import pytest

from routing_replay import RoutingLayout
from routing_replay.errors import InvalidArgumentError
from routing_replay.ray import StoreOptions, node_store

LAYOUT = RoutingLayout(num_layers=2, top_k=2, num_experts=8)


def test_the_options_are_what_create_takes_and_are_checked():
    options = StoreOptions(capacity_tokens=4096, page_tokens=16, spill_dir="/x", job_watch_s=None)
    assert options.create_kwargs() == {
        "capacity_tokens": 4096,
        "page_tokens": 16,
        "max_samples": None,
        "spill_dir": "/x",
        "spill_budget": None,
    }
    for watch in (0, -1.0, float("inf"), 1e10, "5", True):  # before: a raw TypeError for "5",
        with pytest.raises(InvalidArgumentError, match=r"job_watch_s must be seconds in \(0"):
            StoreOptions(job_watch_s=watch)  # and 1e10 killed the actor's job watch
    for bad in ({"capacity_tokens": "x"}, {"page_tokens": 0}, {"max_samples": 1.5}):
        with pytest.raises(InvalidArgumentError, match=f"{next(iter(bad))} must be"):
            StoreOptions(**bad)
    with pytest.raises(InvalidArgumentError, match=r"must be a routing_replay\.ray\.StoreOptions"):
        node_store("job", LAYOUT, {"capacity_tokens": 4096})  # refused before Ray is asked


def test_sizes_are_checked_whole_where_the_caller_is_and_kept_as_python_ints():
    # Before: accepted here, refused by the actor at create (a Ray traceback), or wrapped.
    with pytest.raises(InvalidArgumentError, match=r"needs 8589934592 pages of 128 tokens"):
        StoreOptions(capacity_tokens=1 << 40)
    with pytest.raises(InvalidArgumentError, match="spill_budget=4096 without a spill_dir"):
        StoreOptions(spill_budget=4096)  # before: silently ignored
    with pytest.raises(InvalidArgumentError, match="spill_dir must be an absolute path"):
        StoreOptions(spill_dir="spill")  # before: the actor's working directory
    options = StoreOptions(capacity_tokens=np.int16(1000), page_tokens=np.uint64(64))
    assert options.create_kwargs()["page_tokens"] == 64
    assert [type(options.capacity_tokens), type(options.page_tokens)] == [int, int]
