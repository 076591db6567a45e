"""Reads of token ranges: each row holds exactly the requested tokens, in order, and only
those tokens are copied. Checked against slices of a full read, over samples that share
their prompt pages (a GRPO group), with random and two-chunk (context-parallel) ranges."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest
import torch

from routing_replay import PutRequest, RoutingLayout, RoutingStore, to_torch
from routing_replay.errors import InvalidArgumentError, TokenMismatchError
from routing_replay.reader import cu_seqlens
from routing_replay.store import read as read_module

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=16, moe_layers=(0, 2))
P = 8


@pytest.fixture
def group(name):
    """A store holding a GRPO group: 4 samples of one 20-token prompt (2 shared full pages),
    completions of 5-30 tokens, and one sample put without token ids."""
    rng = np.random.default_rng(0)
    prompt_ids, prompt_routes = rng.integers(3, 500, 20), LAYOUT.random_routes(rng, 20)
    samples = {}
    requests = []
    for j, n in enumerate((5, 13, 30, 8)):
        routes = np.concatenate([prompt_routes, LAYOUT.random_routes(rng, n)])
        routes[-1] = -1
        tokens = np.concatenate([prompt_ids, rng.integers(3, 500, n)])
        samples[f"g{j}"] = (routes, tokens)
        requests.append(PutRequest(f"g{j}", routes, prompt_len=20, token_ids=tokens))
    bare = LAYOUT.random_routes(rng, 17)
    samples["bare"] = (bare, None)
    requests.append(PutRequest("bare", bare, prompt_len=4))
    with RoutingStore.create(name, LAYOUT, capacity_tokens=64 * P, page_tokens=P) as store:
        refs = store.put_many(requests)
        assert store.stats().pages_used < sum(-(-len(r) // P) for r, _ in samples.values())
        yield store, refs, samples


def expected(samples, ref, part, pairs):
    """The rows a full read gives, sliced by hand: routes, token ids, prompt tokens."""
    routes, tokens = samples[ref.sample_id]
    lo = ref.prompt_len if part == "completion" else 0
    index = np.concatenate([np.arange(lo + a, lo + b) for a, b in pairs]).astype(int)
    prompt = int((index < ref.prompt_len).sum())
    return routes[index], None if tokens is None else tokens[index], prompt


def random_pairs(rng, length: int) -> list[tuple[int, int]]:
    cuts = np.sort(rng.integers(0, length + 1, 2 * int(rng.integers(1, 4))))
    return [(int(a), int(b)) for a, b in cuts.reshape(-1, 2)]


def cp_chunks(length: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """Context parallel's load-balanced split: 2*cp chunks, rank r takes r and 2cp-1-r."""
    edges = np.linspace(0, length, 2 * cp + 1).astype(int)
    first, second = rank, 2 * cp - 1 - rank
    return [
        (int(edges[first]), int(edges[first + 1])),
        (int(edges[second]), int(edges[second + 1])),
    ]


@pytest.mark.parametrize("part", ["all", "prompt", "completion"])
def test_random_and_context_parallel_ranges_equal_slices_of_a_full_read(group, part):
    store, refs, samples = group
    rng = np.random.default_rng(1)
    for trial in range(40):
        lengths = [len(store.get(r, part)) for r in refs]
        if trial % 2:
            cp = int(rng.integers(1, 4))
            ranges = [cp_chunks(n, cp, int(rng.integers(0, cp))) for n in lengths]
        else:
            ranges = [random_pairs(rng, n) for n in lengths]
        batch = store.read(refs, part=part, ranges=ranges)
        routes = to_torch(batch).numpy()
        bounds = cu_seqlens(batch).tolist()
        for i, (ref, pairs) in enumerate(zip(refs, ranges, strict=True)):
            want, want_tokens, prompt = expected(samples, ref, part, pairs)
            np.testing.assert_array_equal(routes[bounds[i] : bounds[i + 1]], want)
            assert batch.column("num_tokens")[i].as_py() == len(want)
            assert batch.column("prompt_len")[i].as_py() == prompt
            got_tokens = batch.column("token_ids")[i].as_py()
            assert got_tokens == (None if want_tokens is None else want_tokens.tolist())


def test_only_the_requested_tokens_are_copied(group, monkeypatch):
    store, refs, _ = group
    planned = []
    real = read_module.ReadPlan.copies

    def spy(self, pieces):
        copies = real(self, pieces)
        planned.append(copies)
        return copies

    monkeypatch.setattr(read_module.ReadPlan, "copies", spy)
    store.read(refs[:3], ranges=[(2, 3), [(0, 0), (9, 17)], [(20, 21), (40, 50)]])
    (copies,) = planned
    # (row, first token in the rows, count): exactly the requested tokens, nothing else.
    per_row = [(int(r), int(d), int(n)) for r, d, _, n in copies.tolist()]
    assert sum(n for _, _, n in per_row) == 1 + 8 + 1 + 10
    assert [r for r, _, _ in per_row] == sorted(r for r, _, _ in per_row)  # rows in order
    covered = sorted((d, d + n) for _, d, n in per_row)
    assert covered[0][0] == 0 and covered[-1][1] == 20
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))  # no gaps, no overlap


def test_token_checks_work_on_slices(group):
    store, refs, samples = group
    ranges = [[(0, 4), (21, 24)], [(10, 22)]]
    batch = store.read(refs[1:3], ranges=ranges)
    trained = np.concatenate(
        [
            samples[ref.sample_id][1][a:b]
            for ref, pairs in zip(refs[1:3], ranges, strict=True)
            for a, b in pairs
        ]
    )
    to_torch(batch, input_ids=torch.from_numpy(trained))  # the rollout's tokens: passes
    trained[5] += 1
    with pytest.raises(TokenMismatchError, match=r"sample 'g1': .* position 5"):
        to_torch(batch, input_ids=torch.from_numpy(trained))


@pytest.mark.parametrize(
    ("ranges", "words"),
    [
        ([(3, 2)], "must rise"),
        ([(0, 34)], "stay within its 33 tokens"),
        ([[(0, 5), (4, 9)]], "not overlap"),
        ([(-1, 2)], "pair of ints >= 0"),
        ([(0.5, 2)], "pair of ints >= 0"),
        (["0:2"], "pair of ints >= 0"),
        ([[]], "pair of ints >= 0"),
        ([(0, 2), (0, 2)], "2 entries for 1 refs"),
    ],
)
def test_bad_ranges_raise_and_change_nothing(group, ranges, words):
    store, refs, _ = group
    before = store.stats()
    with pytest.raises(InvalidArgumentError, match=words):
        store.read(refs[1:2], ranges=ranges)
    assert store.stats() == before
    store.verify()


@pytest.mark.parametrize("part", ["all", "completion"])
def test_the_wire_form_rebuilds_the_same_rows_and_ships_shared_pages_once(group, part):
    # What a node store actor ships to a reader on another node: each stored token once.
    store, refs, samples = group
    rng = np.random.default_rng(2)
    for trial in range(20):
        lengths = [len(store.get(r, part)) for r in refs]
        ranges = None if trial == 0 else [random_pairs(rng, n) for n in lengths]
        wire = store.read_wire(refs, part, ranges=ranges)
        rebuilt, direct = wire.batch(), store.read(refs, part=part, ranges=ranges)
        assert rebuilt.equals(direct), trial
        for i, ref in enumerate(refs):  # and both are the samples' own rows
            pairs = [(0, lengths[i])] if ranges is None else ranges[i]
            want, _, _ = expected(samples, ref, part, pairs)
            got = to_torch(rebuilt.slice(i, 1)).numpy()
            np.testing.assert_array_equal(got, want)
    # Whole samples: the shared prompt's 2 full pages (16 tokens) travel once, not 4 times.
    wire = store.read_wire(refs)
    routed = sum(len(r) for r, _ in samples.values())
    assert wire.num_stored == routed - 3 * 16
    assert sum(map(len, wire.tokens)) == routed - 3 * 16  # token ids alike
    assert {r.shape[1] for r in wire.routes} == {LAYOUT.values_per_token}
    per_token = LAYOUT.bytes_per_token + 4  # narrow ids + an int32 token id
    assert wire.nbytes == (routed - 3 * 16) * per_token + wire.request.copies.nbytes


def test_a_ship_that_keeps_views_of_the_store_is_refused(group):
    # A `ship` that keeps (returns, wraps, queues) or writes into the views it is given: a
    # release and a later put would rebuild another sample's routes under this id (before:
    # no error; round 12 caught only a WireBatch returned as it was).
    store, refs, _ = group
    queue = []
    derived = [  # views made from the views, and an Arrow array over one (round 15)
        lambda w: w._replace(routes=[r[:] for r in w.routes]),
        lambda w: [r.ravel() for r in w.routes],
        lambda w: pa.array(w.routes[0].ravel()),
    ]
    for keeps in (lambda w: w, lambda w: (w,), lambda w: {"w": w}, queue.append, *derived):
        with pytest.raises(InvalidArgumentError, match="ship` kept views of the store"):
            store.read_wire(refs, ship=keeps)
        queue.clear()

    def writes(wire):
        wire.routes[0][0] = 0

    with pytest.raises(ValueError, match="read-only"):
        store.read_wire(refs, ship=writes)
    assert store.read_wire(refs).batch().equals(store.read(refs))  # (gathered: copies)
    store.verify()


def test_a_ship_that_raises_leaves_nothing_that_keeps_the_store_open(name):
    # `ray.put` failing (the object store full) or a Ctrl-C inside `ship`: its error can be
    # kept and the store closed meanwhile (before: the views in `ship`'s frame kept the
    # mapping, close() raised a raw BufferError, and an owner's block left it mapped).
    class Full(Exception):
        pass

    def full(views):
        raise Full("object store full")

    def serialize(views):
        raise MemoryError

    def wrapped(views):  # the views in a helper's frame, on the chained error (round 17)
        try:
            serialize(views)
        except MemoryError as e:
            raise Full("could not serialise") from e

    def sending():  # a long-lived generator sender, which keeps the error it met
        views = None
        while True:
            views = yield
            try:
                serialize(views)
            except MemoryError as e:
                sender.last = e

    class Sender:
        pass

    sender = Sender()
    gen = sending()
    next(gen)

    def through_a_generator(views):
        gen.send(views)
        raise Full("not sent") from sender.last

    for ship in (full, wrapped):
        with RoutingStore.create(name, LAYOUT, capacity_tokens=64 * P, page_tokens=P) as store:
            store.put("a", LAYOUT.random_routes(np.random.default_rng(0), 10))
            with pytest.raises(Full) as raised:
                store.read_wire(["a"], ship=ship)
            kept = raised.value  # (a retry loop that collects its errors)
            store.close()  # the owner's block then removes it: nothing stays mapped
        assert kept.__traceback__ is not None
    # A generator of the caller's that keeps the views is left running (round 18: clearing
    # its frame closed it); the store closes once it lets go of them.
    with RoutingStore.create(name, LAYOUT, capacity_tokens=64 * P, page_tokens=P) as store:
        store.put("a", LAYOUT.random_routes(np.random.default_rng(0), 10))
        with pytest.raises(Full):
            store.read_wire(["a"], ship=through_a_generator)
        assert gen.gi_frame is not None
        gen.send(None)  # the sender lets go of them
        store.close()


def test_the_wire_form_of_ranges_ships_only_their_tokens(group):
    store, refs, _ = group
    ranges = [[(0, 3), (10, 14)], (2, 5), (12, 22), (0, 0), (4, 9)]
    wire = store.read_wire(refs, ranges=ranges)
    # Shared prompt page 0 (tokens 0-7): g0 and g1 need 0-4, sent once (5); shared page 1
    # (8-15): g0 10-13 and g2 12-15 overlap, their union 10-15 (6); g2's own 16-21 (6);
    # "bare" its 4-8 (5). Nothing else.
    assert wire.num_stored == 5 + 6 + 6 + 5
    assert wire.batch().equals(store.read(refs, ranges=ranges))


def test_ranges_from_a_generator_and_out_in_device_memory(group):
    """A generator of ranges reads as its list (before: a raw TypeError); `out` numpy cannot
    view (a meta or GPU tensor) is an InvalidArgumentError saying what to pass."""
    store, refs, _ = group
    pairs = [(0, 3), (1, 5)]
    assert store.read(refs[:2], ranges=(p for p in pairs)).equals(
        store.read(refs[:2], ranges=pairs)
    )
    with pytest.raises(InvalidArgumentError, match="one entry per ref, got int"):
        store.read(refs[:2], ranges=3)
    with pytest.raises(InvalidArgumentError, match="out must be host memory numpy can view"):
        store.read(refs[:1], out=torch.empty(1 << 14, dtype=torch.uint8, device="meta"))
    # Before: a raw TypeError (object arrays); the rows built in a copy numpy made and the
    # caller's `out` left as it was (a list, bytes, str).
    for out in (np.empty(1 << 14, dtype=object), [0] * (1 << 14), b"x" * (1 << 14), "x" * 99):
        with pytest.raises(InvalidArgumentError, match=r"out must be host memory numpy can view"):
            store.read(refs[:1], out=out)


@pytest.mark.parametrize("chunk", [1 << 20, 25])
def test_the_wire_form_of_256_experts_crosses_in_one_byte_per_id(
    name, tmp_path, chunk, monkeypatch
):
    # DeepSeek-V3's 256 experts: stored in two bytes only for the missing marker. Narrowed,
    # ids cross in one byte, the marker's places listed apart. Expert 255 (whose low byte
    # is the marker's) is chosen often; rows and single ids are missing; one sample spilled.
    # Narrowed in one chunk, and in chunks of 25 ids (2 rows: chunks end inside runs).
    monkeypatch.setattr(read_module, "NARROW_CHUNK", chunk)
    wide = RoutingLayout(num_layers=4, top_k=3, num_experts=256, moe_layers=(1, 2, 3))
    rng = np.random.default_rng(5)
    prompt = wide.random_routes(rng, 20)
    samples, requests = {}, []
    for j, n in enumerate((9, 30, 3)):
        routes = np.concatenate([prompt, wide.random_routes(rng, n)])
        routes[rng.random(routes.shape[:2]) < 0.3, 0] = 255  # distinct ids: slot 0 only
        routes[rng.random(routes.shape[:2]) < 0.1, 1] = -1  # single ids missing
        routes[-1] = -1  # a whole row
        samples[f"w{j}"] = routes
        requests.append(PutRequest(f"w{j}", routes, prompt_len=20))
    with RoutingStore.create(
        name, wide, 14 * P, page_tokens=P, spill_dir=tmp_path, spill_budget=10**7
    ) as store:
        refs = store.put_many(requests[:2])
        refs.append(store.put("w2", samples["w2"], prompt_len=20))
        spilled = store.put("late", wide.random_routes(rng, 5 * P))  # some spill
        assert store.stats().samples_spilled > 0
        refs.append(spilled)
        for trial in range(10):
            ranges = None if trial == 0 else [random_pairs(rng, r.num_tokens) for r in refs]
            plain = store.read_wire(refs, ranges=ranges)
            narrow = store.read_wire(refs, ranges=ranges, ship=lambda w: w.narrowed())
            assert narrow.missing is not None and plain.missing is None
            assert {r.dtype for r in narrow.routes} == {np.dtype(np.uint8)}
            assert narrow.batch().equals(store.read(refs, ranges=ranges)), trial
            if trial == 0:  # the samples' own rows, and half the route bytes
                for i, ref in enumerate(refs[:3]):
                    got = to_torch(narrow.batch().slice(i, 1)).numpy()
                    np.testing.assert_array_equal(got, samples[ref.sample_id])
                per_row = (np.concatenate(plain.routes) == wide.missing).sum(axis=1)
                whole = per_row == wide.values_per_token  # listed once: column -1
                marks = int(whole.sum() + per_row[~whole].sum())
                assert len(narrow.missing) == marks and whole.any() and per_row[~whole].any()
                route_bytes = sum(r.nbytes for r in plain.routes)
                assert narrow.nbytes == plain.nbytes - route_bytes // 2 + 16 * marks
        out = np.zeros(4 * sum(r.num_tokens for r in refs) * wide.bytes_per_token, np.uint8)
        wire = store.read_wire(refs, ship=lambda w: w.narrowed())
        assert wire.batch(out).equals(store.read(refs))
