"""`capture` and `replay` blocks stopped as they exit (Ctrl-C, at each line of package code
after the exit's first): the model routes natively and records nothing afterwards, and a new
block of any thread or asyncio task works. A stop at the exit's very first line is the one
left (docs/replay.md)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from line_stops import interrupted_at
from moe_models import tiny_model

from routing_replay import RoutingReplayError, capture, replay
from routing_replay.model.adapters import find_routers

PROMPT = torch.tensor([[9, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])


def forced_routes(layout, shape, seed):
    rng = np.random.default_rng(seed)
    keys = rng.random((*shape, layout.num_moe_layers, layout.num_experts))
    return torch.from_numpy(np.argsort(keys, -1)[..., : layout.top_k].astype(np.int32))


def test_a_replay_block_stopped_at_each_line_of_its_exit_leaves_native_routing():
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes = forced_routes(layout, PROMPT.shape, seed=1)
    with torch.no_grad():
        native = model(input_ids=PROMPT).logits
        with replay(model, routes, layout=layout):
            forced = model(input_ids=PROMPT).logits
    assert not torch.equal(forced, native)
    stop, stops = 2, 0
    while True:
        block = replay(model, routes, layout=layout)
        block.__enter__()
        seen, _ = interrupted_at(stop, lambda b=block: b.__exit__(None, None, None))
        if seen < stop:  # ran to its end: every line was a stop point
            break
        stops += 1
        with torch.no_grad():  # outside any block: native, not the stopped block's routes
            assert torch.equal(model(input_ids=PROMPT).logits, native), stop
            with replay(model, routes, layout=layout):  # a new block enters and forces
                assert torch.equal(model(input_ids=PROMPT).logits, forced), stop
        stop += 1
    assert stops >= 3


def capture_in_thread(model, got: list[int]) -> None:
    """A block of another thread (not refused): the samples it records."""
    with capture(model) as fresh, torch.no_grad():
        model(input_ids=PROMPT)
    got.append(len(fresh.routes()))


@pytest.mark.slow
def test_a_capture_block_stopped_at_each_line_of_its_exit_records_nothing_after():
    model = tiny_model("qwen3_moe").eval()
    stop, stops = 2, 0
    while True:
        cap = capture(model)
        cap.__enter__()
        with torch.no_grad():
            model(input_ids=PROMPT)
        seen, _ = interrupted_at(stop, lambda c=cap: c.__exit__(None, None, None))
        if seen < stop:
            break
        stops += 1
        with torch.no_grad():
            model(input_ids=PROMPT)  # recorded by nothing
            out = model.generate(PROMPT, max_new_tokens=2, eos_token_id=None, do_sample=False)
        assert len(cap.routes()) == 2, stop  # its own forward's samples only
        got: list[int] = []
        worker = threading.Thread(target=capture_in_thread, args=(model, got))
        worker.start()
        worker.join()
        assert got == [2], stop
        with capture(model) as fresh, torch.no_grad():
            assert torch.equal(
                model.generate(PROMPT, max_new_tokens=2, eos_token_id=None, do_sample=False), out
            )
        assert [t.tolist() for t in fresh.token_ids()] == out.tolist(), stop
        stop += 1
    assert stops >= 5


def test_a_block_entered_while_another_exits_is_refused_or_keeps_its_routes():
    # Block b tries to enter at each line of block a's exit (a signal handler): it is refused
    # while a holds the model, or it enters and keeps its routes. Before: entered at a line
    # after the exit's first, b had its state wiped by the rest of a's exit and routed
    # natively.
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes_a, routes_b = (forced_routes(layout, PROMPT.shape, seed=s) for s in (1, 2))
    with torch.no_grad():
        native = model(input_ids=PROMPT).logits
        with replay(model, routes_b, layout=layout):
            forced_b = model(input_ids=PROMPT).logits
    stop, refused = 1, 0
    while True:
        a, b = replay(model, routes_a, layout=layout), replay(model, routes_b, layout=layout)
        a.__enter__()
        got: list = []

        def enter_b(b=b, got=got):
            try:
                got.append(b.__enter__())
            except RoutingReplayError as e:
                got.append(e)

        seen, _ = interrupted_at(stop, lambda a=a: a.__exit__(None, None, None), action=enter_b)
        if seen < stop:
            break
        with torch.no_grad():
            after = model(input_ids=PROMPT).logits
        if got[0] is b:
            assert torch.equal(after, forced_b), stop
            b.__exit__(None, None, None)
        else:
            assert "already active" in str(got[0]), stop
            assert torch.equal(after, native), stop
            refused += 1
        stop += 1
    assert refused >= 3 and stop >= 5


@pytest.mark.slow
def test_a_models_first_block_stopped_at_each_line_of_its_entry_leaves_it_replayable():
    # The entry of the first block on a model prepares it (replay's router code, decoder
    # hooks; a capture block's entry too, then its own hooks). Before: a stop after the
    # hooks were registered and before their handles were kept left a second pair on the
    # next entry, and every replayed forward of the model raised "finished without calling
    # the routers" for good.
    import copy

    template = tiny_model("qwen3_moe").eval()  # never prepared: each stop gets a copy
    layout = find_routers(template).layout
    routes = forced_routes(layout, PROMPT.shape, seed=1)
    with torch.no_grad():
        native = template(input_ids=PROMPT).logits
        prepared = copy.deepcopy(template)
        with replay(prepared, routes, layout=layout):
            forced = prepared(input_ids=PROMPT).logits
    assert not torch.equal(forced, native)
    stop, stops = 1, 0
    while True:
        model = copy.deepcopy(template)
        block = capture(model)
        seen, _ = interrupted_at(stop, block.__enter__)
        if seen < stop:
            block.__exit__(None, None, None)
            break
        stops += 1
        with torch.no_grad():
            assert torch.equal(model(input_ids=PROMPT).logits, native), stop
            with replay(model, routes, layout=layout):
                assert torch.equal(model(input_ids=PROMPT).logits, forced), stop
            with capture(model) as cap:
                model(input_ids=PROMPT)
        assert len(cap.routes()) == 2, stop
        stop += 1
    assert stops >= 100
