"""`capture` and `replay` blocks belong to the code that entered them (its thread, and the
asyncio tasks it starts inside the block): another thread's forwards on the same model are
neither recorded nor forced, and capture says how many it saw."""

from __future__ import annotations

import asyncio
import copy
import functools
import threading

import numpy as np
import pytest
import torch
from compiling import reset_dynamo
from line_stops import interrupted_at
from moe_models import tiny_model
from test_two_stacks import stacks, tiny_diffusion_gemma
from tiny_families import random_routes, tiny_family_model

from routing_replay import RoutingReplayError, capture, replay
from routing_replay.model.adapters import find_routers

PROMPT = torch.tensor([[9, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
OTHER = torch.tensor([[11, 12, 13], [14, 15, 16]])


def test_a_capture_block_records_only_its_own_threads_forwards():
    model = tiny_model("qwen3_moe").eval()
    with capture(model) as alone, torch.no_grad():
        model(input_ids=PROMPT)
    stop, ran, errors = threading.Event(), threading.Event(), []

    def other():  # plain forwards, no block, as fast as it can
        try:
            with torch.no_grad():
                while not stop.is_set():
                    model(input_ids=OTHER)
                    ran.set()
        except Exception as e:
            errors.append(e)

    worker = threading.Thread(target=other, daemon=True)
    try:
        warns = pytest.warns(RuntimeWarning, match=r"forward\(s\) of other threads .* not rec")
        with warns, capture(model) as cap, torch.no_grad():
            worker.start()
            for _ in range(20):
                model(input_ids=PROMPT)
            assert ran.wait(60)  # the other thread ran a forward while the block was open
    finally:
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


def experts_0_and_1(layout):
    """Routes of PROMPT naming experts 0 and 1 at every token and layer."""
    routes = torch.zeros((*PROMPT.shape, layout.num_moe_layers, layout.top_k), dtype=torch.int32)
    routes[..., 1] = 1
    return routes


async def _forward(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_capture_block_in_a_task_records_the_tasks_it_starts():
    # Before: a block entered inside a task recorded none of the forwards of tasks it
    # started (gather, wait_for, create_task): silently empty.
    model = tiny_model("qwen3_moe").eval()
    with capture(model) as alone, torch.no_grad():
        for ids in (PROMPT, OTHER, PROMPT, OTHER):
            model(input_ids=ids)

    async def main():
        with capture(model) as cap:
            await asyncio.gather(_forward(model, PROMPT), _forward(model, OTHER))
            await asyncio.wait_for(_forward(model, PROMPT), timeout=60)
            await asyncio.create_task(_forward(model, OTHER))
        return cap

    cap = asyncio.run(main())
    want = PROMPT.tolist() + OTHER.tolist()
    assert [t.tolist() for t in cap.token_ids()] == want * 2
    assert len(cap.routes()) == 8
    for got, exact in zip(cap.routes(), alone.routes(), strict=True):
        assert np.array_equal(got, exact)


def test_a_task_started_before_the_block_is_not_recorded_and_is_counted():
    model = tiny_model("qwen3_moe").eval()

    async def main():
        go = asyncio.Event()

        async def earlier():  # an unrelated request of the same event loop
            await go.wait()
            return await _forward(model, OTHER)

        task = asyncio.create_task(earlier())
        await asyncio.sleep(0)
        warns = pytest.warns(RuntimeWarning, match=r"1 forward\(s\) of other threads")
        with warns, capture(model) as cap:
            go.set()
            await task
            await _forward(model, PROMPT)
        return cap

    cap = asyncio.run(main())
    assert [t.tolist() for t in cap.token_ids()] == PROMPT.tolist()


@pytest.mark.parametrize("block", ["capture", "replay"])
def test_a_forward_sent_to_another_thread_from_inside_a_block_is_refused(block):
    # asyncio.to_thread carries the block's context into a worker thread, where its hooks
    # could interleave with the block's own forwards. Before: capture recorded nothing.
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes = experts_0_and_1(layout)

    async def main():
        opened = capture(model) if block == "capture" else replay(model, routes, layout=layout)
        with opened, torch.no_grad():
            await asyncio.to_thread(model, input_ids=PROMPT)

    match = "another thread" if block == "capture" else "thread or asyncio task other than"
    with pytest.raises(RoutingReplayError, match=match):
        asyncio.run(main())
    with capture(model) as after, torch.no_grad():  # nothing left open or marked
        model(input_ids=PROMPT)
    assert len(after.routes()) == 2


def test_a_replay_block_in_a_task_forces_the_tasks_it_starts():
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes = experts_0_and_1(layout)
    with replay(model, routes, layout=layout), torch.no_grad():
        forced = model(input_ids=PROMPT).logits

    async def main():
        with replay(model, routes, layout=layout):
            return await asyncio.gather(_forward(model, PROMPT), _forward(model, PROMPT))

    for got in asyncio.run(main()):
        assert torch.equal(got, forced)


@pytest.mark.compile
@pytest.mark.parametrize("other", ["thread", "task"])
def test_a_compiled_models_forward_from_another_thread_or_task_is_refused(other):
    # Compiled code skipped the eager owner check. Before: another thread's forward, or an
    # unrelated task's while the block's task awaited, was forced with the block's routes.
    from compiling import reset_dynamo

    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes = experts_0_and_1(layout)
    reset_dynamo()
    compiled = torch.compile(model, backend="eager")

    def forward():
        with torch.no_grad():
            return compiled(input_ids=PROMPT).logits

    native = forward()
    with replay(model, routes, layout=layout):
        forced = forward()
    assert not torch.equal(forced, native)
    got = []

    def attempt():
        try:
            got.append(forward())
        except RoutingReplayError as e:
            got.append(str(e))

    if other == "thread":
        with replay(model, routes, layout=layout):
            worker = threading.Thread(target=attempt)
            worker.start()
            worker.join()
            assert torch.equal(forward(), forced)  # the block's own: still forced
    else:

        async def main():
            go, done = asyncio.Event(), asyncio.Event()

            async def trainer():
                with replay(model, routes, layout=layout):
                    go.set()
                    await done.wait()
                    return forward()

            async def unrelated():
                await go.wait()
                attempt()
                done.set()

            task = asyncio.create_task(trainer())
            await unrelated()
            return await task

        assert torch.equal(asyncio.run(main()), forced)
    assert "thread or asyncio task other than the one" in got[0]
    assert torch.equal(forward(), native)  # after the block: native
    reset_dynamo()


class CaptureInReplay(threading.Thread):
    """Thread B: capture and replay blocks on `model`, a forward, a wait for `go_on`, a
    second forward; `outcome` holds the recorded routes or the refusal."""

    def __init__(self, model, routes, layout, ids) -> None:
        super().__init__(daemon=True)
        self.model, self.routes, self.layout, self.ids = model, routes, layout, ids
        self.first_done, self.go_on, self.outcome = threading.Event(), threading.Event(), []

    def run(self) -> None:
        model, ids = self.model, self.ids
        try:
            with (
                torch.no_grad(),
                capture(model) as cap,
                replay(model, self.routes, layout=self.layout),
            ):
                model(input_ids=ids)
                self.first_done.set()
                self.go_on.wait(60)
                model(input_ids=ids)
            self.outcome.append(cap.routes())
        except RoutingReplayError as e:
            self.outcome.append(e)
        finally:
            self.first_done.set()

    def enter_and_forward(self) -> None:
        self.start()
        self.first_done.wait(60)


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 9])
def test_a_capture_block_exiting_while_another_thread_enters_keeps_its_forced_ids(stride):
    # Thread A's capture exit paused at each line while thread B enters capture and replay
    # on the model and forwards, then again once A is done: B records the forced ids, or
    # is refused while A's block is still open (before: A's exit turned off the ids forced
    # calls keep for a capture, under B's open block: Llama 4's native choice recorded).
    model = tiny_family_model("llama4_text")
    layout = find_routers(model).layout
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(4))
    routes = random_routes(layout, seed=5, missing=0.0)
    want = [r.numpy() for r in routes.to(torch.int32)] * 2  # two forwards of two samples

    def a_exits(stop: int, at_stop) -> int:
        """A's block, one forward, then its exit in thread A, `at_stop()` run at its line
        event `stop`; the exit's line events."""
        block = capture(model)
        with torch.no_grad():
            block.__enter__()
            model(input_ids=ids)
        seen = []
        exit_block = functools.partial(block.__exit__, None, None, None)
        a = threading.Thread(
            target=lambda: seen.append(interrupted_at(stop, exit_block, action=at_stop))
        )
        a.start()
        a.join(60)
        return seen[0][0]

    events = a_exits(0, None)
    exact = refused = 0
    for stop in range(1, events + 1, stride):
        b = CaptureInReplay(model, routes, layout, ids)
        a_exits(stop, b.enter_and_forward)
        b.go_on.set()
        b.join(60)
        (result,) = b.outcome
        if isinstance(result, RoutingReplayError):  # A's block still open at that line
            assert "another thread" in str(result), stop
            refused += 1
            continue
        assert len(result) == 4, stop
        for got, routes_of in zip(result, want, strict=True):
            assert np.array_equal(got, routes_of), f"A stopped at line event {stop} of {events}"
        exact += 1
    assert exact > refused and events > 20


def kept_ids(model) -> int:
    """Ids the model's forced router calls keep for capture blocks (`forcing.forced_ids`)."""
    from routing_replay.model.forcing import ReplayingForward, wrapped

    moe = find_routers(model)
    slots = [wrapped(vars(r.module).get(r.method), ReplayingForward) for r in moe.all_routers]
    return sum(len(s.chosen) for s in slots if s is not None)


def test_no_forced_ids_are_kept_after_blocks_whose_calls_ran_in_other_threads():
    # A checkpoint recompute in autograd's own thread (CUDA's device threads), and a replay
    # block exited from another thread than its forwards': once the blocks end, the model
    # keeps no ids (before: one [T, K] tensor per router, until that thread's next call).
    model = tiny_family_model("llama4_text").train()
    layout = find_routers(model).layout
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(4))
    routes = random_routes(layout, seed=5, missing=0.0)
    model.activation_checkpointing_enable({"use_reentrant": False})
    with capture(model), replay(model, routes, layout=layout):
        loss = model(input_ids=ids).logits.float().square().mean()
        backward = threading.Thread(target=loss.backward)
        backward.start()
        backward.join()
    assert kept_ids(model) == 0
    model.activation_checkpointing_disable()
    block = replay(model, routes, layout=layout)

    def forward_in_a_block():
        block.__enter__()
        with torch.no_grad():
            model(input_ids=ids)

    with pytest.warns(RuntimeWarning, match=r"1 forward\(s\) of other threads"), capture(model):
        worker = threading.Thread(target=forward_in_a_block)
        worker.start()
        worker.join()
        assert kept_ids(model) == 3  # the block's forward, one per router: not recorded here
        block.__exit__(None, None, None)
    assert kept_ids(model) == 0


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.compile
def test_a_recompute_in_another_thread_of_layers_compiled_one_by_one_is_forced(fullgraph):
    # Torch's checkpoint_wrapper around layers compiled one by one, the backward run in
    # another thread (as autograd's device threads run it on CUDA): the recomputes, compiled
    # code in a thread not the block's, are forced like the forward, so the gradients equal
    # those of the backward in the block's own thread. Under fullgraph=True, where that
    # cannot be told without a graph break, the backward fails saying so (never native).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    reset_dynamo()
    model = tiny_model("qwen3_moe").train()
    layout = find_routers(model).layout
    routes = experts_0_and_1(layout)
    for i, layer in enumerate(model.model.layers):  # (checkpointed around the compiled layer)
        compiled = torch.compile(layer, backend="eager", fullgraph=fullgraph)
        model.model.layers[i] = checkpoint_wrapper(compiled)

    def gradients(in_thread: bool) -> list[torch.Tensor]:
        model.zero_grad()
        with replay(model, routes, layout=layout):
            loss = model(input_ids=PROMPT).logits.float().square().mean()
            if in_thread:
                failed = []
                backward = threading.Thread(target=lambda: _or_error(loss.backward, failed))
                backward.start()
                backward.join()
                if failed:
                    raise failed[0]
            else:
                loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    own = gradients(False)
    if fullgraph:
        with pytest.raises(Exception, match="a thread other than the replay block's ran router"):
            gradients(True)
    else:
        other = gradients(True)
        gate = model.model.layers[0].mlp.gate.weight.grad
        assert gate is not None and gate.abs().sum() > 0
        assert len(own) == len(other)
        assert all(torch.equal(a, b) for a, b in zip(own, other, strict=True))
    reset_dynamo()


def _or_error(call, failed: list) -> None:
    try:
        call()
    except Exception as e:
        failed.append(e)


def forward_or_refusal(model, outcome: list) -> None:
    """One forward of PROMPT: its logits, or its `RoutingReplayError`, into `outcome`."""
    try:
        with torch.no_grad():
            outcome.append(model(input_ids=PROMPT).logits)
    except RoutingReplayError as e:
        outcome.append(e)


@pytest.mark.parametrize("then", ["b-ends", "a-forwards", "a-exits"])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_another_threads_forward_running_when_a_block_is_entered_is_never_forced(compiled, then):
    # Thread B's forward holds after its embedding; thread A enters a replay block; B runs its
    # layers and holds before its final norm; then B ends, or A forwards or exits first. B is
    # never forced silently: eager, its routers check their owner (native, or refused); its
    # layers compiled one by one (as torchtitan does) check only that replay is on, so B,
    # whose forward overlapped the block's entry, is refused at its end (before: forced with
    # A's routes, silently; eager B was refused as "a fused MoE kernel").
    reset_dynamo()
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    with torch.no_grad():
        native = model(input_ids=PROMPT).logits
    routes = experts_0_and_1(layout)
    if compiled:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer, backend="eager")
    with torch.no_grad():  # the model prepared (and both variants compiled) before the race
        model(input_ids=PROMPT)
        with replay(model, routes, layout=layout):
            model(input_ids=PROMPT)
    steps = {name: threading.Event() for name in ("embedded", "entered", "layered", "go")}
    outcome = []

    def hold(at: str, until: str):
        def hook(module, *args):
            if threading.current_thread().name == "B":
                steps[at].set()
                steps[until].wait(30)

        return hook

    hooks = [
        model.model.embed_tokens.register_forward_hook(hold("embedded", "entered")),
        model.model.norm.register_forward_pre_hook(hold("layered", "go")),
    ]
    worker = threading.Thread(
        target=forward_or_refusal, args=(model, outcome), name="B", daemon=True
    )
    try:
        worker.start()
        assert steps["embedded"].wait(30)
        # (under a capture block: B's forced layers keep their ids for capture, to be dropped)
        with capture(model), replay(model, routes, layout=layout):
            steps["entered"].set()
            assert steps["layered"].wait(30)
            if then == "a-forwards":
                with torch.no_grad():
                    model(input_ids=PROMPT)
            if then != "a-exits":
                steps["go"].set()
                worker.join(60)
        steps["go"].set()
        worker.join(60)
    finally:
        for event in steps.values():
            event.set()
        for hook in hooks:
            hook.remove()
    (result,) = outcome
    if compiled or isinstance(result, RoutingReplayError):
        assert isinstance(result, RoutingReplayError), "forced with the other thread's routes"
        assert "while another thread entered or exited a replay block" in str(result)
    else:
        assert torch.equal(result, native)
    assert kept_ids(model) == 0


@pytest.mark.parametrize(
    ("whole", "block"),
    [("model", "b-ends-after"), ("decoder", "b-ends-inside"), ("model+fullgraph-layers", "")],
)
@pytest.mark.compile
def test_another_threads_forward_resumed_in_compiled_code_under_a_block_routes_natively(
    whole, block
):
    # The model (or its decoder) compiled as a whole, graph breaks after its embedding and
    # before its final norm: thread B's forward (replay off) holds at the first while thread
    # A enters a replay block, runs its layers in code compiled with replay on, and holds at
    # the second; B ends inside A's block, or after A exits it. B routes natively, never
    # forced (before: its layers forced with A's routes, silently: compiled router code
    # took every forward for the block's, and the compiled decoder took no notes).
    reset_dynamo()
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes = experts_0_and_1(layout)
    with torch.no_grad():
        native = model(input_ids=PROMPT).logits
    steps = {name: threading.Event() for name in ("embedded", "entered", "layered", "go")}

    def hold(at: str, until: str):
        @torch._dynamo.disable  # (a graph break in every thread)
        def hook(module, *args):
            if threading.current_thread().name == "B":
                steps[at].set()
                steps[until].wait(30)

        return hook

    hooks = [
        model.model.embed_tokens.register_forward_hook(hold("embedded", "entered")),
        model.model.norm.register_forward_pre_hook(hold("layered", "go")),
    ]
    if whole == "model+fullgraph-layers":  # (each layer one graph, begun under the block)
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer, backend="eager", fullgraph=True)
    if whole.startswith("model"):
        compiled = torch.compile(model, backend="eager")
    else:
        model.model.compile(backend="eager")
        compiled = model
    with torch.no_grad():  # both variants compiled before the race
        compiled(input_ids=PROMPT)
        with replay(model, routes, layout=layout):
            forced = compiled(input_ids=PROMPT).logits
    assert not torch.allclose(forced, native)
    outcome = []

    def b_forwards():
        try:
            with torch.no_grad():
                outcome.append(compiled(input_ids=PROMPT).logits)
        except Exception as e:  # (torch's error under fullgraph=True: no hold reached)
            outcome.append(e)
            steps["layered"].set()

    worker = threading.Thread(target=b_forwards, name="B", daemon=True)
    try:
        worker.start()
        assert steps["embedded"].wait(30)
        with replay(model, routes, layout=layout):
            steps["entered"].set()
            assert steps["layered"].wait(30)
            with torch.no_grad():  # the block's own forwards are forced as before
                assert torch.equal(compiled(input_ids=PROMPT).logits, forced)
            if block == "b-ends-inside":
                steps["go"].set()
                worker.join(60)
        steps["go"].set()
        worker.join(60)
    finally:
        for event in steps.values():
            event.set()
        for hook in hooks:
            hook.remove()
    (result,) = outcome
    if whole == "model+fullgraph-layers":  # (a graph break is an error there: said so)
        assert isinstance(result, Exception), "forced with the other thread's routes"
        assert "a thread other than the replay block's ran router code" in str(result)
    else:
        assert not isinstance(result, Exception), result
        assert torch.equal(result, native), "forced with the other thread's routes"
    assert kept_ids(model) == 0
    reset_dynamo()


def compiled_layers_model():
    """qwen3_moe with its layers compiled one by one (backend eager), its native and its
    forced (experts 0 and 1) variants compiled before a race: model, layout, routes,
    native logits, forced logits."""
    reset_dynamo()
    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes = experts_0_and_1(layout)
    with torch.no_grad():
        native = model(input_ids=PROMPT).logits
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend="eager")
    with torch.no_grad():
        model(input_ids=PROMPT)
        with replay(model, routes, layout=layout):
            forced = model(input_ids=PROMPT).logits
    return model, layout, routes, native, forced


@pytest.mark.compile
def test_a_forward_nested_in_another_does_not_hide_a_block_entered_under_it():
    # Thread A's forward (replay off, layers compiled one by one, which check only that
    # replay is on) holds after its embedding while thread B enters a replay block; there A
    # forwards the model again, nested, and is refused; then the outer forward runs its
    # layers under B's block. It is refused at its end, never returned forced (before: the
    # nested forward's note of the new epoch replaced the outer one's, which then passed).
    model, layout, routes, native, forced = compiled_layers_model()
    assert not torch.allclose(forced, native)
    entered, done, nested = threading.Event(), threading.Event(), []

    def b_holds_a_block():
        with replay(model, routes, layout=layout):
            entered.set()
            done.wait(30)

    def nest_once(module, args, output):
        if threading.current_thread().name == "B" or nested:
            return
        worker.start()
        assert entered.wait(30)
        forward_or_refusal(model, nested)

    worker = threading.Thread(target=b_holds_a_block, name="B", daemon=True)
    hook = model.model.embed_tokens.register_forward_hook(nest_once)
    outer = []
    try:
        forward_or_refusal(model, outer)
    finally:
        done.set()
        hook.remove()
        worker.join(60)
    assert "thread or asyncio task other than the one" in str(nested[0])
    (result,) = outer
    assert isinstance(result, RoutingReplayError), "forced with the other thread's routes"
    assert "while another thread entered or exited a replay block" in str(result)
    with torch.no_grad():  # the notes of both forwards are gone: the next one is native
        assert torch.equal(model(input_ids=PROMPT).logits, native)
    reset_dynamo()


@pytest.mark.compile
def test_another_threads_forward_starting_at_each_line_of_a_block_entry_is_never_forced():
    # Thread B's forward starts at each line of thread A's replay entry (layers compiled one
    # by one, which check only that replay is on) and ends after it: B is refused or native,
    # never forced (before: started between the entry's new epoch and its flag, B noted the
    # new epoch with replay off, and its layers were forced with A's routes, silently).
    model, layout, routes, native, _ = compiled_layers_model()

    def enter_with_b_at(stop: int) -> tuple[int, list]:
        block, outcome, embedded, entered = (
            replay(model, routes, layout=layout),
            [],
            *(
                threading.Event(),
                threading.Event(),
            ),
        )

        def hold(module, args, output):
            if threading.current_thread().name == "B":
                embedded.set()
                entered.wait(30)

        worker = threading.Thread(
            target=forward_or_refusal, args=(model, outcome), name="B", daemon=True
        )

        def start_b():
            worker.start()
            while not embedded.wait(0.01) and worker.is_alive():  # (or refused before it)
                pass

        hook = model.model.embed_tokens.register_forward_hook(hold)
        try:
            seen, _ = interrupted_at(stop, block.__enter__, action=start_b)
            entered.set()
            if stop and seen >= stop:
                worker.join(60)
            block.__exit__(None, None, None)
        finally:
            entered.set()
            hook.remove()
        return seen, outcome

    events, _ = enter_with_b_at(0)
    for stop in range(1, events + 1):
        _, outcome = enter_with_b_at(stop)
        (result,) = outcome
        if not isinstance(result, RoutingReplayError):
            assert torch.equal(result, native), f"B forced, started at line {stop} of {events}"


def test_forwards_stopped_by_ctrl_c_leave_a_bounded_number_of_notes():
    # A KeyboardInterrupt inside a forward skips its end (torch's always_call hooks run for
    # an Exception only): its note stays. A thread keeps at most 32 per model, and forwards
    # after them are checked by their own notes (before: one more per interrupt, for good).
    from routing_replay.model import owner
    from routing_replay.model.forcing import _STATE

    model = tiny_model("qwen3_moe").eval()
    layout = find_routers(model).layout
    routes = experts_0_and_1(layout)
    with torch.no_grad():
        native = model(input_ids=PROMPT).logits
        with replay(model, routes, layout=layout):
            forced = model(input_ids=PROMPT).logits

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    hook = model.model.embed_tokens.register_forward_hook(interrupt)
    for _ in range(40):
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(input_ids=PROMPT)
    hook.remove()
    state = model.model.__dict__[_STATE]
    assert len(owner._THREAD.admitted[state]) == 32
    with torch.no_grad():
        assert torch.equal(model(input_ids=PROMPT).logits, native)
        with replay(model, routes, layout=layout):
            assert torch.equal(model(input_ids=PROMPT).logits, forced)
    assert len(owner._THREAD.admitted[state]) <= 32


def test_the_notes_of_forwards_go_with_their_models():
    # Each forward notes per thread whether it is its block's; models dropped leave no note
    # (before: one per model state and thread, for good, and a new state given a freed id
    # read the dead model's note).
    import gc
    import weakref

    from routing_replay.model import owner
    from routing_replay.model.forcing import _STATE

    model = tiny_model("qwen3_moe").eval()
    routes = experts_0_and_1(find_routers(model).layout)
    with torch.no_grad(), replay(model, routes, layout=find_routers(model).layout):
        model(input_ids=PROMPT)
    gc.collect()
    before = len(owner._THREAD.admitted)  # (this model's, and those of models still alive)
    states = []
    for _ in range(5):
        other = copy.deepcopy(model)
        with torch.no_grad(), replay(other, routes, layout=find_routers(other).layout):
            other(input_ids=PROMPT)
        states.append(weakref.ref(find_routers(other).decoder.__dict__[_STATE]))
        del other
    gc.collect()
    assert all(state() is None for state in states)  # nothing held them
    assert len(owner._THREAD.admitted) <= before  # (earlier tests' models may go too)
