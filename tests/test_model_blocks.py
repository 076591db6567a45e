"""`capture` and `replay` blocks entered, stopped and exited in the orders threads, signal
handlers and event loops produce: two threads entering replay blocks at once, an entry
stopped at each of its lines, capture blocks exited out of order or while another thread
enters one, a block around `asyncio.run`, a checkpoint's recompute of a forward that ran
outside the block."""

from __future__ import annotations

import asyncio
import copy
import threading

import numpy as np
import pytest
import torch
from line_stops import interrupted_at
from moe_models import CONFIGS, seeded_moe, tiny_model
from tiny_families import random_routes, tiny_family_model
from transformers import DynamicCache

from routing_replay import RoutingReplayError, capture, replay
from routing_replay.errors import UnsupportedGenerationError, UnsupportedModelError
from routing_replay.model.adapters import find_routers

PROMPT = torch.tensor([[9, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])


def forced_routes(layout, shape, seed):
    rng = np.random.default_rng(seed)
    keys = rng.random((*shape, layout.num_moe_layers, layout.num_experts))
    return torch.from_numpy(np.argsort(keys, -1)[..., : layout.top_k].astype(np.int32))


def logits(model):
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


@pytest.fixture(scope="module")
def qwen():
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes = [forced_routes(layout, PROMPT.shape, seed=s) for s in (1, 2)]
    native = logits(model)
    forced = []
    for r in routes:
        with replay(model, r, layout=layout):
            forced.append(logits(model))
    assert not torch.equal(forced[0], native) and not torch.equal(forced[0], forced[1])
    return model, layout, routes, native, forced


def enter_in_thread(block, outcome: list) -> threading.Thread:
    def run():
        try:
            block.__enter__()
            outcome.append("entered")
        except RoutingReplayError as e:
            outcome.append(str(e))

    worker = threading.Thread(target=run)
    worker.start()
    return worker


@pytest.mark.slow
def test_two_threads_entering_replay_blocks_at_once_one_is_refused(qwen):
    # Thread B enters its block at each line of A's entry (A's thread waits for it there):
    # exactly one of the two is entered, and the model forces its routes.
    model, layout, routes, native, forced = qwen
    stop, stops = 1, 0
    while True:
        a, b = (replay(model, r, layout=layout) for r in routes)
        got: list = []
        workers: list = []

        def other(b=b, got=got, workers=workers):
            workers.append(enter_in_thread(b, got))
            workers[0].join()

        try:
            seen, _ = interrupted_at(stop, a.__enter__, action=other)
            a_in = True
        except RoutingReplayError as e:
            assert "already active" in str(e)
            seen, a_in = stop, False
        for worker in workers:
            worker.join()
        if seen < stop:  # ran to its end: every line was a stop point
            a.__exit__(None, None, None)
            break
        stops += 1
        b_in = got == ["entered"]
        assert a_in != b_in, (stop, a_in, got)
        winner, want = (a, forced[0]) if a_in else (b, forced[1])
        if a_in:
            assert "already active" in got[0], (stop, got)
            assert torch.equal(logits(model), want), stop
        winner.__exit__(None, None, None)
        assert torch.equal(logits(model), native), stop
        stop += 1
    assert stops >= 10


@pytest.mark.slow
def test_a_replay_entry_stopped_at_each_line_leaves_native_routing(qwen):
    model, layout, routes, native, forced = qwen
    stop, stops = 1, 0
    while True:
        block = replay(model, routes[0], layout=layout)
        seen, entered = interrupted_at(stop, block.__enter__)
        if seen < stop:
            block.__exit__(None, None, None)
            break
        stops += 1
        assert entered is None
        assert torch.equal(logits(model), native), stop  # no block was entered
        with replay(model, routes[1], layout=layout):  # and a new one enters and forces
            assert torch.equal(logits(model), forced[1]), stop
        stop += 1
    assert stops >= 10


QUIET = pytest.mark.filterwarnings("ignore:replay\\(\\) exited before backward")


@QUIET
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recompute_of_a_forward_run_outside_the_block_is_refused(qwen, reentrant):
    # The model was prepared by earlier blocks (the fixture's). Before: the recompute of a
    # forward run outside the block was forced with the block's routes whenever the block
    # had run as many forwards (reentrant: wrong gradients, no error).
    model, layout, routes = qwen[:3]
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    refused = pytest.raises(RoutingReplayError, match="did not run in the active replay block")
    try:
        outside = model(input_ids=PROMPT).logits.square().mean()
        with replay(model, routes[0], layout=layout), refused:
            model(input_ids=PROMPT).logits.square().mean()  # the block's own, not backwarded
            outside.backward()
        outside = model(input_ids=PROMPT).logits.square().mean()
        with replay(model, routes[0], layout=layout):
            inside = model(input_ids=PROMPT).logits.square().mean()
            with refused:
                (outside + inside).backward()
        # The block's own forward, backward twice (retain_graph): recomputed each time.
        model.zero_grad()
        with replay(model, routes[0], layout=layout):
            loss = model(input_ids=PROMPT).logits.square().mean()
            loss.backward(retain_graph=True)
            first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            model.zero_grad()
            loss.backward()
            second = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))
    finally:
        model.gradient_checkpointing_disable()
        model.zero_grad()
        model.eval()


@QUIET
@pytest.mark.parametrize(
    ("mode", "wrapped"), [("train", "before"), ("eval", "after"), ("eval", "before")]
)
def test_a_recompute_under_torchs_checkpoint_wrapper_is_refused_in_any_mode(mode, wrapped):
    # torch's checkpoint_wrapper on the layers (reentrant), put on before or after the model
    # was first prepared, in train or eval mode (grad on): the recompute of a forward run
    # outside the block, backwarded inside it, is refused (before: forced with the block's
    # routes, silently: the check sat on the wrapper, whose recompute skips its hooks, or
    # assumed checkpointing recomputes only in training mode).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    model = tiny_model("qwen3_moe")
    layout = find_routers(model).layout
    routes = forced_routes(layout, PROMPT.shape, seed=1)

    def wrap():
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(
                layer, checkpoint_impl=CheckpointImpl.REENTRANT
            )

    if wrapped == "before":
        wrap()
    with replay(model, routes, layout=layout):  # prepared, as after a first step
        pass
    if wrapped == "after":
        wrap()
    model.train(mode == "train")
    outside = model(input_ids=PROMPT).logits.square().mean()
    refused = pytest.raises(RoutingReplayError, match="did not run in the active replay block")
    with replay(model, routes, layout=layout), refused:
        outside.backward()
    model.zero_grad()
    with replay(model, routes, layout=layout):  # the block's own forward: recomputed, forced
        model(input_ids=PROMPT).logits.square().mean().backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


@QUIET
def test_another_threads_recompute_is_refused_not_forced(qwen):
    model, layout, routes = qwen[:3]
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    try:
        got: list = []
        losses = [model(input_ids=PROMPT).logits.square().mean()]  # B's forward, no block

        def backward():  # B's backward while A's block is active
            try:
                losses[0].backward()
                got.append("done")
            except RoutingReplayError as e:
                got.append(str(e))

        with replay(model, routes[0], layout=layout):
            model(input_ids=PROMPT).logits.square().mean()  # A's, not backwarded
            worker = threading.Thread(target=backward)
            worker.start()
            worker.join()
        assert "did not run in the active replay block" in got[0]
    finally:
        model.gradient_checkpointing_disable()
        model.zero_grad()
        model.eval()


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_model_copied_inside_a_block_comes_out_closed(qwen, how, tmp_path):
    # Before: a copy made inside a replay block forced that block's routes forever and
    # refused new blocks; one made inside a capture block raised on every forward.
    _, layout, routes, native, forced = qwen
    model = tiny_model("qwen3_moe").eval()  # (the fixture's was checkpointed: not picklable)

    def copied():
        if how == "deepcopy":
            return copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        return torch.load(tmp_path / "model.pt", weights_only=False)

    with replay(model, routes[0], layout=layout):
        twin = copied()
    assert torch.equal(logits(twin), native)
    with replay(twin, routes[1], layout=layout):
        assert torch.equal(logits(twin), forced[1])
    with capture(model) as cap:
        logits(model)
        twin = copied()
    assert torch.equal(logits(twin), native)
    assert len(cap.routes()) == 2  # the original block, not its copy's forwards
    with capture(twin) as again:
        out = generated(twin)
    with capture(model) as alone:
        assert torch.equal(generated(model), out)
    for got, want in zip(again.routes(), alone.routes(), strict=True):
        assert np.array_equal(got, want)


@pytest.mark.slow
def test_generate_stopped_at_each_line_leaves_no_samples_and_the_block_records_on(qwen):
    # Ctrl-C at every other line of package code a captured generate runs; the caller goes on in
    # the same block with plain forwards. Before: a stop on a few lines of the generate
    # wrapper left the call's samples, or filed every later forward into its dead group.
    model = qwen[0]
    prompts = [PROMPT[:, :4], PROMPT]
    with capture(model) as alone, torch.no_grad():
        for prompt in prompts:
            model(input_ids=prompt)
    stop, stops = 1, 0
    while True:
        with capture(model) as cap:
            seen, _ = interrupted_at(stop, lambda: generated(model))
            if seen < stop:
                break
            stops += 1
            with torch.no_grad():
                for prompt in prompts:
                    model(input_ids=prompt)
        assert len(cap.routes()) == 4, stop
        for got, want in zip(cap.routes(), alone.routes(), strict=True):
            assert np.array_equal(got, want), stop
        stop += 2  # every other line: each line of the wrapper is one of several per step
    assert stops >= 50


def generated(model):
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=3, eos_token_id=None, do_sample=False)


def wrapped_once(model) -> None:
    """Each of generate's methods passes through one capture dispatcher: none was stranded
    or chained by blocks that came and went."""
    for name in ("generate", "prepare_inputs_for_generation"):
        node, found = vars(model).get(name), 0
        for _ in range(8):
            found += type(node).__name__ == "_Dispatch"
            node = getattr(node, "__wrapped__", None)
        assert found == 1, name


def test_capture_blocks_exited_out_of_order_keep_generate_recorded(qwen):
    model = qwen[0]
    with capture(model) as alone:
        out = generated(model)
    want = [r.shape for r in alone.routes()]
    a, b = capture(model), capture(model)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the first block exits first
    assert torch.equal(generated(model), out)
    c = capture(model).__enter__()  # entered, exited between b's
    c.__exit__(None, None, None)
    assert torch.equal(generated(model), out)
    b.__exit__(None, None, None)
    wrapped_once(model)
    assert [r.shape for r in b.routes()] == want * 2  # both calls, each sample cut as alone
    for got, exact in zip(b.routes(), alone.routes() * 2, strict=True):
        assert np.array_equal(got, exact)
    assert a.routes() == [] and c.routes() == []


@pytest.mark.slow
def test_a_capture_block_entered_while_another_threads_exits_records_generate(qwen):
    model = qwen[0]
    with capture(model) as alone:
        out = generated(model)
    stop, stops = 3, 0  # (after the exit's first lines: `try:`, the block closed)
    while True:
        ours = capture(model).__enter__()
        theirs: list = []

        def other(theirs=theirs):
            def run():
                block = capture(model).__enter__()
                try:
                    theirs.append((block, generated(model)))
                finally:
                    block.__exit__(None, None, None)

            worker = threading.Thread(target=run)
            worker.start()
            worker.join(0.5)
            theirs.append(worker)

        seen, _ = interrupted_at(stop, lambda o=ours: o.__exit__(None, None, None), action=other)
        for item in theirs:
            if isinstance(item, threading.Thread):
                item.join()
        if seen < stop:
            break
        stops += 1
        (block, got) = next(x for x in theirs if isinstance(x, tuple))
        assert torch.equal(got, out), stop
        assert len(block.routes()) == 2, stop
        for routes, exact in zip(block.routes(), alone.routes(), strict=True):
            assert np.array_equal(routes, exact), stop
        wrapped_once(model)
        stop += 1
    assert stops >= 5


@pytest.mark.slow
def test_a_capture_entry_stopped_at_each_line_refuses_no_one_after(qwen):
    model = qwen[0]
    stop, stops = 1, 0
    while True:
        block = capture(model)
        seen, _ = interrupted_at(stop, block.__enter__)
        if seen < stop:
            block.__exit__(None, None, None)
            break
        stops += 1
        got: list = []

        def other(got=got):
            with capture(model) as fresh, torch.no_grad():
                model(input_ids=PROMPT)
            got.append(len(fresh.routes()))

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert got == [2], stop
        wrapped_once(model)
        stop += 1
    assert stops >= 5


def test_blocks_around_asyncio_run_own_its_tasks(qwen):
    model, layout, routes, _, forced = qwen

    async def forward():
        return logits(model)

    with capture(model) as cap:
        asyncio.run(forward())
    assert [t.tolist() for t in cap.token_ids()] == PROMPT.tolist()
    with replay(model, routes[0], layout=layout):
        assert torch.equal(asyncio.run(forward()), forced[0])


@pytest.mark.parametrize("first", ["capture", "replay"])
def test_a_routing_method_records_the_forced_ids_whichever_block_entered_first(first):
    # DBRX routes in a block's method, which capture wraps: replay's forward goes beneath
    # it. Before: a capture block entered before the replay block recorded native ids.
    model = tiny_family_model("dbrx").eval()
    layout = find_routers(model).layout
    routes = random_routes(layout, seed=3, missing=0.0)
    ids = torch.randint(1, 50, tuple(routes.shape[:2]), generator=torch.Generator().manual_seed(4))
    blocks = [capture(model), replay(model, routes, layout=layout)]
    with blocks[first == "replay"], blocks[first == "capture"], torch.no_grad():
        model(input_ids=ids)
    got = np.sort(np.stack(blocks[0].routes()), -1)
    assert np.array_equal(got, np.sort(routes.numpy(), -1))


@QUIET
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recompute_of_a_forward_over_the_same_embeddings_outside_the_block_is_refused(
    reentrant,
):
    # Forward A outside the block and forward B inside it over one embeddings tensor: the
    # first layer's inputs were one storage, so A's recompute passed for B's (reentrant:
    # forced with the block's routes, wrong gradients, no error). MoE in the first layer
    # only: a later one's fresh input would be refused first.
    config = CONFIGS["qwen3_moe"]()
    config.mlp_only_layers = list(range(1, config.num_hidden_layers))
    model = seeded_moe(config, 0, torch.float32)
    layout = find_routers(model).layout
    routes = [forced_routes(layout, PROMPT.shape, seed=1)]
    with replay(model, routes[0], layout=layout):  # prepared, as after a first step
        pass
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    try:
        embeds = model.get_input_embeddings()(PROMPT).detach().requires_grad_()
        outside = model(inputs_embeds=embeds).logits.square().mean()
        refused = pytest.raises(RoutingReplayError, match="did not run in the active replay block")
        with replay(model, routes[0], layout=layout), refused:
            model(inputs_embeds=embeds).logits.square().mean()
            outside.backward()
    finally:
        model.gradient_checkpointing_disable()
        model.zero_grad()
        model.eval()


class CallsTheModel:
    """A logits processor that forwards the model itself (on a cache of its own)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, scores):
        self.model(input_ids=input_ids)
        return scores


@pytest.mark.parametrize("extra", ["guidance", "processor"])
def test_generate_running_other_forwards_of_the_model_is_refused(qwen, extra):
    # Before: classifier-free guidance's unconditional forwards (or a processor's) went into
    # the generation's sample: its prompt rows the last token's alone, or another prompt's.
    model = qwen[0]
    with capture(model) as alone, torch.no_grad():
        model(input_ids=PROMPT)
    if extra == "guidance":
        kwargs, match = {"guidance_scale": 1.5}, "classifier-free guidance"
    else:
        kwargs, match = {"logits_processor": [CallsTheModel(model)]}, "a cache other than its own"
    with capture(model) as cap, torch.no_grad():
        model(input_ids=PROMPT)
        with pytest.raises(UnsupportedGenerationError, match=match):
            model.generate(PROMPT, max_new_tokens=3, eos_token_id=None, do_sample=False, **kwargs)
    assert len(cap.routes()) == 2  # the forward before, nothing of the refused call
    for got, want in zip(cap.routes(), alone.routes(), strict=True):
        assert np.array_equal(got, want)


@pytest.mark.slow
def test_a_forward_stopped_at_each_line_beside_a_decode_loop_leaves_the_loop_recorded(qwen):
    # A hand-written decode loop in a capture block, an unrelated forward (its own cache)
    # stopped at each line; the loop goes on. Before: a stop between a new sample's group
    # and its first forward left an empty group, and every later decode step raised.
    model = qwen[0]
    prompt, other = PROMPT[:1, :4], torch.tensor([[11, 12, 13]])

    def loop(stop):
        with capture(model) as cap, torch.no_grad():
            cache = DynamicCache()
            out = model(input_ids=prompt, cache=cache, use_cache=True)
            seen, _ = interrupted_at(
                stop, lambda: model(input_ids=other, cache=DynamicCache(), use_cache=True)
            )
            for _ in range(3):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        return seen, cap.routes()[0]

    total, want = loop(0)
    for stop in range(1, total + 1):
        _, got = loop(stop)
        assert np.array_equal(got, want), stop


@pytest.mark.slow
def test_capture_records_a_model_compiled_before_its_blocks(qwen):
    # Before: code compiled before the block ran without the block's hooks (Dynamo does not
    # guard on hooks added since): no sample recorded, no error.
    from compiling import reset_dynamo

    model = tiny_model("qwen3_moe").eval()
    with capture(model) as alone, torch.no_grad():
        native = model(input_ids=PROMPT).logits
    reset_dynamo()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=PROMPT).logits, native)
        for _ in range(2):  # each block records, the next one too
            with capture(model) as cap:
                assert torch.equal(compiled(input_ids=PROMPT).logits, native)
            assert len(cap.routes()) == 2
            for got, want in zip(cap.routes(), alone.routes(), strict=True):
                assert np.array_equal(got, want)
        compiled(input_ids=PROMPT)  # outside a block: recorded by none
    assert len(cap.routes()) == 2


@pytest.mark.slow
def test_capture_under_fullgraph_compile_says_why_it_cannot(qwen):
    # Before: Dynamo's own error about asyncio (capture's owner lookup), naming nothing of
    # capture's. Its bookkeeping runs between graphs: fullgraph=True cannot hold it.
    from compiling import reset_dynamo

    model = tiny_model("qwen3_moe").eval()
    reset_dynamo()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    refused = pytest.raises(torch._dynamo.exc.Unsupported, match="compile without fullgraph")
    with torch.no_grad(), capture(model) as cap, refused:
        compiled(input_ids=PROMPT)
    assert cap.routes() == []
    reset_dynamo()


def test_a_block_closed_while_its_generate_runs_drops_that_generates_samples(qwen):
    # Another thread (a watchdog) closes the block at step 3 of a generate. Before: the
    # samples were kept at full length with the later steps' rows -1, as if never forwarded.
    from transformers import LogitsProcessor, LogitsProcessorList

    model = qwen[0]
    cap = capture(model)

    class CloseAtStep3(LogitsProcessor):
        step = 0

        def __call__(self, ids, scores):
            self.step += 1
            if self.step == 3:
                other = threading.Thread(target=cap.__exit__, args=(None, None, None))
                other.start()
                other.join()
            return scores

    cap.__enter__()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="closed while generate ran"):
        out = model.generate(
            input_ids=PROMPT,
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
            logits_processor=LogitsProcessorList([CloseAtStep3()]),
        )
    assert out.shape == (2, PROMPT.shape[1] + 6)
    assert cap.routes() == []


def test_capture_refuses_the_stance_that_skips_guards(qwen):
    import torch._dynamo  # (the stance's state lives there)

    model = qwen[0]
    stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    refused = pytest.raises(UnsupportedModelError, match=r"capture: .*skip_guard_eval_unsafe")
    with stance, refused, capture(model):
        pass
    with capture(model) as cap, torch.no_grad():  # the refused block left nothing behind
        model(input_ids=PROMPT)
    assert len(cap.routes()) == 2
    # Set inside a block, the stance goes unseen by compiled code: said at the exit.
    for block in (capture(model), replay(model, qwen[2][0], layout=qwen[1])):
        with pytest.warns(RuntimeWarning, match=r"skip_guard_eval_unsafe=True\) is in effect at"):
            try:
                with block:
                    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
            finally:
                torch.compiler.set_stance("default")


@pytest.mark.slow
def test_capture_blocks_in_a_row_on_a_compiled_model_routing_in_a_method_record_each(qwen):
    # DBRX routes in a method of its MoE block, which capture wraps. Before: compiled code
    # traced the wrapper's lookup and kept the first block's action: later blocks raised
    # "finished without calling the routers".
    from compiling import reset_dynamo

    model = tiny_family_model("dbrx").eval()
    ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(4))
    with capture(model) as alone, torch.no_grad():
        model(input_ids=ids)
    reset_dynamo()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(input_ids=ids)
        for _ in range(4):
            with capture(model) as cap:
                compiled(input_ids=ids)
            assert len(cap.routes()) == 2
            for got, want in zip(cap.routes(), alone.routes(), strict=True):
                assert np.array_equal(got, want)
    reset_dynamo()


@pytest.mark.slow
def test_a_copy_made_inside_a_capture_block_compiles_with_fullgraph(qwen):
    # The copy keeps the closed block's hooks (inert). Before: they broke the graph before
    # seeing the block closed, so fullgraph=True failed on a model with no block open.
    from compiling import reset_dynamo

    model = tiny_model("qwen3_moe").eval()
    with capture(model):
        twin = copy.deepcopy(model)
    reset_dynamo()
    with torch.no_grad():
        got = torch.compile(twin, backend="eager", fullgraph=True)(input_ids=PROMPT).logits
        assert torch.equal(got, model(input_ids=PROMPT).logits)
    reset_dynamo()


def test_two_models_sharing_their_routers_are_told_apart():
    # A second model over the same layers prepared inside the first's block takes the
    # routers: the first's forward is refused saying so (before: "a fused MoE kernel").
    first = tiny_family_model("qwen3_vl_moe_text")
    second = tiny_family_model("qwen3_vl_moe_text")
    second.layers = first.layers
    layout = find_routers(first).layout
    routes = random_routes(layout, seed=5, missing=0.0)
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    refused = pytest.raises(UnsupportedModelError, match="prepared for replay by another")
    inner = replay(second, routes, layout=layout)
    with torch.no_grad(), replay(first, routes, layout=layout), inner, refused:
        first(input_ids=ids)
    with torch.no_grad(), replay(first, routes, layout=layout):  # its own again
        first(input_ids=ids)
