"""Damaged route archives: one bit flipped at each byte of a small archive. Every load either
raises CorruptArchiveError and leaves the store empty, or loads exactly what was put (a flip
in bytes the reader skips). Loads run in a worker process, so a crash is a failure naming
the byte, not the end of pytest."""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import multiprocessing as mp
import os
import signal
import time
import uuid

import numpy as np
import pytest

from routing_replay import (
    PutRequest,
    RoutingLayout,
    RoutingReplayError,
    RoutingStore,
    load_routes,
    save_routes,
)
from routing_replay.store.format import NO_DIGEST
from routing_replay.store.samples import token_digest

LAYOUTS = {
    "uint8": RoutingLayout(num_layers=3, top_k=2, num_experts=16, moe_layers=(0, 2)),
    "uint16": RoutingLayout(num_layers=2, top_k=3, num_experts=300, moe_layers=(0, 1)),
}
HANG_S = 30.0  # a worker that reports nothing for this long is killed: a hang at that byte
# The allowed outcomes. The store has the archive's layout and room for all of it, so a
# refusal can only be the file's fault: CorruptArchiveError, no other routing_replay error.
EXACT, REFUSED = "exact", "raises CorruptArchiveError"


def samples(layout: RoutingLayout) -> list[PutRequest]:
    """Four samples: token ids and prompt_len or not, one version or two spans, a missing row."""
    rng = np.random.default_rng(11)
    holes = layout.random_routes(rng, 10)
    holes[4] = -1
    return [
        PutRequest("a", layout.random_routes(rng, 12), 5, rng.integers(3, 500, 12), 3),
        PutRequest("b", layout.random_routes(rng, 7)),
        PutRequest("c", holes, 4, rng.integers(3, 500, 10), [(0, 1), (6, 2)]),
        PutRequest("d", layout.random_routes(rng, 9), None, None, 7),
    ]


def new_store(layout: RoutingLayout) -> RoutingStore:
    name = f"test-archive-fuzz-{uuid.uuid4().hex[:10]}"
    return RoutingStore.create(name, layout, capacity_tokens=256, page_tokens=8)


def build(tmp_path, layout: RoutingLayout) -> bytes:
    """The archive's bytes: two record batches of two samples each."""
    src = new_store(layout)
    try:
        refs = src.put_many(samples(layout))
        path = tmp_path / "routes.arrow"
        save_routes(path, refs, read=src.read, chunk_tokens=20)
        return path.read_bytes()
    finally:
        src.close()
        src.unlink()


def wrong_load(store: RoutingStore, refs: list, requests: list[PutRequest]) -> str | None:
    """What differs between the loaded samples and the requests put (None: nothing)."""
    if sorted(r.sample_id for r in refs) != sorted(q.sample_id for q in requests):
        return f"loaded {[r.sample_id for r in refs]}"
    by_id = {r.sample_id: r for r in refs}
    for q in requests:
        ref = by_id[q.sample_id]
        row = store.read([ref])
        tokens = row.column("token_ids")[0]
        versions = () if q.policy_version is None else q.policy_version
        if isinstance(versions, int):
            versions = ((0, versions),)
        digest = NO_DIGEST if q.token_ids is None else token_digest(q.token_ids)
        got = (
            store.get(ref).tolist(),
            None if not tokens.is_valid else tokens.values.to_numpy().tolist(),
            ref.prompt_len,
            row.column("prompt_len")[0].as_py(),
            ref.policy_versions,
            ref.tokens_digest,
        )
        want = (
            np.asarray(q.routes).tolist(),
            None if q.token_ids is None else np.asarray(q.token_ids).tolist(),
            q.prompt_len,
            q.prompt_len,
            tuple(tuple(s) for s in versions),
            digest,
        )
        if got != want:
            return f"sample {q.sample_id!r}: {got} != {want}"
    return None


def outcome(store: RoutingStore, path: str, requests: list[PutRequest]) -> str:
    """EXACT, "raises <the routing_replay error>" (store left empty), or what went wrong."""
    try:
        refs = load_routes(path, store)
    except RoutingReplayError as e:
        if len(store) != 0:
            return f"{type(e).__name__} left {len(store)} samples in the store"
        try:
            store.verify()
        except Exception as v:
            return f"{type(e).__name__} left a store failing verify: {v}"
        return f"raises {type(e).__name__}"
    except Exception as e:
        return f"raw {type(e).__name__}: {str(e)[:200]}"
    wrong = wrong_load(store, refs, requests)
    store.release(refs)
    return EXACT if wrong is None else f"wrong load: {wrong}"


def worker(conn, name: str, data: bytes, requests, indices: list[int], tmp: str) -> None:
    """Load each variant (the byte at index i with bit i % 8 flipped; -1: none) into the
    store `name`, reporting (index, outcome) after each."""
    faulthandler.disable()  # a crash is reported by the parent, naming the byte
    store = RoutingStore.attach(name)
    for i in indices:
        damaged = bytearray(data)
        if i >= 0:
            damaged[i] ^= 1 << (i % 8)
        path = os.path.join(tmp, f"variant-{i}.arrow")
        with open(path, "wb") as f:
            f.write(damaged)
        conn.send((i, outcome(store, path, requests)))
        os.unlink(path)
    conn.close()


def death(exitcode: int) -> str:
    if exitcode < 0:
        return f"worker died of {signal.Signals(-exitcode).name}"
    return f"worker exited with {exitcode}"


def fuzz(tmp_path, layout: RoutingLayout, data: bytes, indices: list[int]) -> dict[int, str]:
    """Each index's outcome; a worker that dies is replaced at the next index, with a new
    store (the dead one may have held the old one's lock). Every store is unlinked."""
    requests = samples(layout)
    ctx = mp.get_context("fork")
    outcomes: dict[int, str] = {}
    stores: list[RoutingStore] = []
    try:
        while len(outcomes) < len(indices):
            rest = indices[len(outcomes) :]
            store = new_store(layout)
            stores.append(store)
            recv, send = ctx.Pipe(duplex=False)
            args = (send, store.name, data, requests, rest, str(tmp_path))
            proc = ctx.Process(target=worker, args=args, daemon=True)
            proc.start()
            send.close()
            for i in rest:
                if not recv.poll(HANG_S):  # (a dead worker's pipe polls ready: at EOF)
                    proc.kill()
                    proc.join()
                    outcomes[i] = f"hung (no outcome in {HANG_S:.0f} s)"
                    break
                try:
                    got, what = recv.recv()
                except EOFError:
                    proc.join()
                    outcomes[i] = death(proc.exitcode)
                    break
                assert got == i
                outcomes[i] = what
            proc.join()
            recv.close()
            store.close()
            store.unlink()
            stores.remove(store)
    finally:
        for store in stores:
            with contextlib.suppress(Exception):
                store.close()
            store.unlink()
    return outcomes


def check(tmp_path, kind: str, stride: int, start: int = 0) -> None:
    layout = LAYOUTS[kind]
    data = build(tmp_path, layout)
    indices = [-1, *range(start, len(data), stride)]
    began = time.perf_counter()
    outcomes = fuzz(tmp_path, layout, data, indices)
    seconds = time.perf_counter() - began
    assert outcomes.pop(-1) == EXACT  # the undamaged archive loads
    counts = collections.Counter(what.split(":")[0] for what in outcomes.values())
    print(f"{kind}: {len(outcomes)} of {len(data)} bytes in {seconds:.1f} s: {dict(counts)}")
    bad = {i: what for i, what in outcomes.items() if what not in (EXACT, REFUSED)}
    assert not bad, f"{len(bad)} of {len(outcomes)} flipped bytes: " + "; ".join(
        f"byte {i}: {what}" for i, what in sorted(bad.items())
    )
    # Sample "a"'s stored ids (found by content: only record batch 0 holds them) are read
    # by every load: a flip there is always refused.
    ids = np.asarray(samples(layout)[0].routes).astype(layout.dtype).tobytes()
    at = data.index(ids)
    hit = [i for i in range(at, at + len(ids)) if i in outcomes]
    assert hit and [outcomes[i] for i in hit] == [REFUSED] * len(hit)


@pytest.mark.parametrize("kind", ["uint8"])  # uint16 too under stress, every byte
def test_a_flipped_bit_raises_or_loads_exactly(tmp_path, kind):
    """Every 11th byte (each layout at others): the default tier's share of the fuzz."""
    check(tmp_path, kind, stride=11, start=0 if kind == "uint8" else 5)


@pytest.mark.stress
@pytest.mark.parametrize("kind", ["uint8", "uint16"])
def test_a_flipped_bit_at_every_byte_raises_or_loads_exactly(tmp_path, kind):
    check(tmp_path, kind, stride=1)
