"""`capture` and `replay` blocks belong to the thread and asyncio task that entered them:
another thread's forwards on the same model are neither recorded nor forced."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from moe_models import tiny_model
from test_two_stacks import stacks, tiny_diffusion_gemma

from routing_replay import RoutingReplayError, capture, replay
from routing_replay.model.adapters import find_routers

PROMPT = torch.tensor([[9, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
OTHER = torch.tensor([[11, 12, 13], [14, 15, 16]])


def test_a_capture_block_records_only_its_own_threads_forwards():
    model = tiny_model("qwen3_moe").eval()
    with capture(model) as alone, torch.no_grad():
        model(input_ids=PROMPT)
    stop, errors = threading.Event(), []

    def other():  # plain forwards, no block, as fast as it can
        try:
            with torch.no_grad():
                while not stop.is_set():
                    model(input_ids=OTHER)
        except Exception as e:
            errors.append(e)

    worker = threading.Thread(target=other)
    with capture(model) as cap, torch.no_grad():
        worker.start()
        for _ in range(20):
            model(input_ids=PROMPT)
    stop.set()
    worker.join()
    assert not errors
    assert [t.tolist() for t in cap.token_ids()] == PROMPT.tolist() * 20
    for got, want in zip(cap.routes(), alone.routes() * 20, strict=True):
        assert np.array_equal(got, want)


def test_a_replay_block_refuses_another_threads_forward_and_forces_its_own():
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    rng = np.random.default_rng(3)
    keys = rng.random((*PROMPT.shape, layout.num_moe_layers, layout.num_experts))
    routes = torch.from_numpy(np.argsort(keys, -1)[..., : layout.top_k].astype(np.int32))
    with torch.no_grad():
        native = model(input_ids=PROMPT).logits
        with replay(model, routes, layout=layout):
            forced = model(input_ids=PROMPT).logits
    assert not torch.equal(forced, native)
    got = []

    def other():
        try:
            with torch.no_grad():
                got.append(model(input_ids=PROMPT).logits)
        except RoutingReplayError as e:
            got.append(str(e))

    with replay(model, routes, layout=layout), torch.no_grad():
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert torch.equal(model(input_ids=PROMPT).logits, forced)
    assert "called from a thread or asyncio task other than the one" in got[0]
    with torch.no_grad():  # the other thread, no block active: native
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert torch.equal(got[1], native)


def test_an_open_capture_block_is_not_entered_again():
    model = tiny_model("qwen3_moe").eval()
    with capture(model) as cap, torch.no_grad():
        with pytest.raises(RoutingReplayError, match="already open"), cap:
            pass
        model(input_ids=PROMPT)
        model(input_ids=PROMPT)
    assert len(cap.routes()) == 4  # both forwards, the block still open after the refusal


def test_a_stack_given_a_dict_mask_drops_the_padding_its_wrapper_was_told_of():
    # DiffusionGemma's encoder hands its stack 4-D masks by layer type: the wrapper's 2-D
    # mask says which columns are padding (before: kept, pad tokens and their routes).
    model = tiny_diffusion_gemma()
    encoder, _ = stacks(model)
    ids = torch.tensor([[0, 0, 21, 22, 23, 24], [31, 32, 33, 34, 35, 36]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with capture(encoder) as cap, torch.no_grad():
        encoder(input_ids=ids, attention_mask=mask)
    assert [t.tolist() for t in cap.token_ids()] == [[21, 22, 23, 24], ids[1].tolist()]
    with capture(encoder) as alone, torch.no_grad():
        encoder(input_ids=ids[:1, 2:])
    assert np.array_equal(cap.routes()[0], alone.routes()[0])


def test_a_wrapper_forward_that_fails_before_its_stack_leaves_no_token_ids_behind():
    model = tiny_diffusion_gemma()
    encoder, _ = stacks(model)
    stack = encoder.language_model
    fails = stack.register_forward_pre_hook(lambda m, a, k: 1 / 0, with_kwargs=True)
    with capture(encoder) as cap, torch.no_grad():
        with pytest.raises(ZeroDivisionError):
            encoder(input_ids=PROMPT)
        fails.remove()
        embeds = stack.embed_tokens(PROMPT + 1)
        stack(inputs_embeds=embeds)  # the stack alone, with embeddings: no token ids known
    assert cap.token_ids() == [None, None]
