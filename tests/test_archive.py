"""Route archives: save refs' samples to an Arrow IPC file and load them into another store,
exactly; damaged files, other layouts and missing refs raise and load nothing."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from routing_replay import (
    Episode,
    PutRequest,
    RoutingLayout,
    RoutingStore,
    load_routes,
    save_routes,
)
from routing_replay.errors import (
    CorruptArchiveError,
    InvalidArgumentError,
    LayoutMismatchError,
    SampleNotFoundError,
    SampleReplacedError,
    StoreFullError,
)
from routing_replay.store.archive import batch_crc
from routing_replay.store.lock import interleave
from routing_replay.store.segment import segment_path

NARROW = RoutingLayout(num_layers=3, top_k=2, num_experts=16, moe_layers=(0, 2))
WIDE = RoutingLayout(num_layers=2, top_k=3, num_experts=300, moe_layers=(0, 1))  # uint16


@pytest.fixture
def stores():
    """Make stores that are removed afterwards."""
    made = []

    def make(layout, capacity_tokens=2048):
        name = f"test-archive-{uuid.uuid4().hex[:10]}"
        store = RoutingStore.create(name, layout, capacity_tokens=capacity_tokens, page_tokens=8)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
        store.unlink()
        assert not os.path.exists(segment_path(store.name))


def fill(store, rng):
    """A GRPO group (shared 20-token prompt), an episode of 3 turns with two policy
    versions, a sample without token ids or prompt_len, one with missing rows."""
    layout = store.layout
    prompt_ids, prompt_routes = rng.integers(3, 500, 20), layout.random_routes(rng, 20)
    requests = []
    for j, n in enumerate((5, 13, 30, 9)):
        routes = np.concatenate([prompt_routes, layout.random_routes(rng, n)])
        routes[-1] = -1
        tokens = np.concatenate([prompt_ids, rng.integers(3, 500, n)])
        requests.append(PutRequest(f"g{j}", routes, 20, tokens, policy_version=3))
    refs = store.put_many(requests)
    episode = Episode(store, "ep", prompt_len=6)
    tokens = rng.integers(3, 500, 6)
    for turn, version in ((1, 4), (2, 4), (3, 5)):
        tokens = np.concatenate([tokens, rng.integers(3, 500, 7 + turn)])
        episode.add_turn(tokens, layout.random_routes(rng, len(tokens)), policy_version=version)
    refs.append(episode.close())
    refs.append(store.put("bare", layout.random_routes(rng, 17)))
    holes = layout.random_routes(rng, 12)
    holes[3:6] = -1
    refs.append(store.put("holes", holes, prompt_len=4, token_ids=rng.integers(3, 500, 12)))
    return refs


@pytest.mark.parametrize("layout", [NARROW, WIDE], ids=["uint8", "uint16"])
@pytest.mark.parametrize("chunk_tokens", [1, 40, 10_000])
def test_round_trip_is_exact(stores, tmp_path, layout, chunk_tokens):
    src = stores(layout)
    refs = fill(src, np.random.default_rng(0))
    path = tmp_path / "routes.arrow"
    nbytes = save_routes(path, refs, read=src.read, chunk_tokens=chunk_tokens)
    assert nbytes == os.path.getsize(path) and not list(tmp_path.glob("*.partial-*"))
    dst = stores(layout)
    new = load_routes(path, dst)
    assert [r.sample_id for r in new] == [r.sample_id for r in refs]
    for old, ref in zip(refs, new, strict=True):
        assert (ref.num_tokens, ref.prompt_len, ref.tokens_digest, ref.policy_versions) == (
            old.num_tokens,
            old.prompt_len,
            old.tokens_digest,
            old.policy_versions,
        )
        assert ref.store == dst.name
    assert dst.read(new).equals(src.read(refs))  # routes, token ids, prompt lens: all of it
    assert new[4].policy_versions == ((0, 4), (23, 5))  # turn 3 (tokens 23-32): version 5
    # The group's shared prompt pages are shared again (the loads put the group together
    # when one batch holds it: chunk_tokens 10_000; page by page otherwise).
    if chunk_tokens == 10_000:
        assert dst.stats().pages_used == src.stats().pages_used


def test_loading_some_refs_returns_them_in_their_order(stores, tmp_path):
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(1))
    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=src.read, chunk_tokens=50)
    dst = stores(NARROW)
    picked = [refs[6], refs[0], refs[3]]
    new = load_routes(path, dst, picked)
    assert [r.sample_id for r in new] == ["holes", "g0", "g3"]
    assert len(dst) == 3
    assert dst.read(new).equals(src.read(picked))


def test_bad_archives_raise_and_load_nothing(stores, tmp_path):
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(2))
    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=src.read, chunk_tokens=40)
    data = path.read_bytes()
    dst = stores(NARROW)
    truncated = tmp_path / "truncated.arrow"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptArchiveError, match="not a complete route archive"):
        load_routes(truncated, dst)
    damaged = tmp_path / "damaged.arrow"
    routes = bytearray(data)
    # A byte of a routes buffer: the stored ids of g2's prompt (found by content).
    stored = src.read([refs[2]])
    first = bytes(stored.column("routed_experts").values.values.buffers()[1])[:24]
    at = bytes(routes).index(first) + 5
    routes[at] ^= 0x01
    damaged.write_bytes(bytes(routes))
    with pytest.raises(CorruptArchiveError, match="CRC"):
        load_routes(damaged, dst)
    with pytest.raises(LayoutMismatchError, match="holds routes of"):
        load_routes(path, stores(RoutingLayout(num_layers=3, top_k=2, num_experts=16)))
    missing = src.put("later", NARROW.random_routes(np.random.default_rng(3), 5))
    with pytest.raises(SampleNotFoundError, match="'later' is not in"):
        load_routes(path, dst, [refs[0], missing])
    # The same id put again with the same tokens, other routes: its ref is not the saved one.
    tokens = src.read([refs[0]]).column("token_ids")[0].values.to_numpy()
    src.release([refs[0]])
    again = src.put(
        "g0", NARROW.random_routes(np.random.default_rng(4), len(tokens)), token_ids=tokens
    )
    assert again.tokens_digest == refs[0].tokens_digest
    with pytest.raises(SampleReplacedError, match="another put"):
        load_routes(path, dst, [again])
    not_ours = tmp_path / "plain.arrow"
    with open(not_ours, "wb") as f, pa_file(f, src.read(refs[1:2]).schema) as w:
        w.write_batch(src.read(refs[1:2]))
    with pytest.raises(CorruptArchiveError, match="not a route archive"):
        load_routes(not_ours, dst)
    assert len(dst) == 0 and dst.stats().pages_used == 0


def test_an_empty_selection_loads_nothing(stores, tmp_path):
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(8))
    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=src.read, chunk_tokens=40)
    dst = stores(NARROW)
    assert load_routes(path, dst, []) == []
    assert len(dst) == 0 and dst.stats().pages_used == 0
    with pytest.raises(LayoutMismatchError, match="holds routes of"):  # the layout still counts
        load_routes(path, stores(WIDE), [])
    with pytest.raises(InvalidArgumentError, match="more than once"):  # one ref twice
        load_routes(path, dst, [refs[0], refs[1], refs[0]])
    assert len(dst) == 0


def test_token_ids_are_checked_against_their_digest_before_any_put(stores, tmp_path):
    """An archive whose token ids (with valid CRCs) are not the ones its digests were made
    of raises before the put: a full store neither fills up nor times out, and no lock of
    the store is taken."""
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(9))

    def read(chunk):  # the refs' samples, the first token id of each changed
        batch = src.read(chunk)
        ids = [None if t is None else [t[0] + 1, *t[1:]] for t in batch["token_ids"].to_pylist()]
        field = batch.schema.field("token_ids")
        return batch.set_column(
            batch.schema.get_field_index("token_ids"), field, pa.array(ids, field.type)
        )

    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=read, chunk_tokens=40)
    full = stores(NARROW, capacity_tokens=64)
    kept = full.put("kept", routes := NARROW.random_routes(np.random.default_rng(10), 64))
    assert full.stats().pages_used == full.stats().pages_total
    points = []
    with interleave(points.append), pytest.raises(CorruptArchiveError, match=r"'g0' .* digest"):
        load_routes(path, full, timeout=0)
    assert points == []  # not even a look-up: no put was attempted
    assert len(full) == 1 and np.array_equal(full.get(kept), routes)
    full.verify()


def test_the_schema_metadata_carries_its_own_crc(stores, tmp_path):
    """A bit flipped in the layout of the footer's schema (16 experts read 17: still valid
    JSON, and the ids still fit uint8) is caught by the metadata's CRC before the layout is
    parsed: the archive loads into neither store."""
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(11))
    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=src.read)
    data = bytearray(path.read_bytes())
    at = data.rindex(b'"num_experts":16') + len(b'"num_experts":1')  # the footer's copy
    data[at] ^= 0x01  # "6" -> "7"
    damaged = tmp_path / "damaged.arrow"
    damaged.write_bytes(bytes(data))
    seventeen = RoutingLayout(num_layers=3, top_k=2, num_experts=17, moe_layers=(0, 2))
    for dst in (stores(NARROW), stores(seventeen)):
        with pytest.raises(CorruptArchiveError, match=r"schema metadata .* fails its CRC"):
            load_routes(damaged, dst)
        assert len(dst) == 0


def test_the_whole_schema_must_be_the_one_save_routes_writes(stores, tmp_path):
    """Fields are checked too (the metadata's CRC covers only the metadata): an archive
    whose serial column was renamed, its metadata intact, is refused; so are one of
    another version and one that lost a record batch."""
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(12))
    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=src.read, chunk_tokens=40)
    with ipc.open_file(path) as f:
        schema, batches = f.schema, [f.get_batch(i) for i in range(f.num_record_batches)]
    assert len(batches) == 6
    dst = stores(NARROW)

    def rewrite(name, schema, batches):
        out = tmp_path / name
        with open(out, "wb") as f, ipc.new_file(f, schema) as w:
            for i, batch in enumerate(batches):
                batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
                w.write_batch(batch, custom_metadata={b"crc32": str(batch_crc(batch, i))})
        return out

    renamed = schema.set(7, schema.field(7).with_name("serials"))
    assert renamed.metadata == schema.metadata
    with pytest.raises(CorruptArchiveError, match=r"schema of .* is not the one save_routes"):
        load_routes(rewrite("renamed.arrow", renamed, batches), dst)
    meta = {**schema.metadata, b"routing_replay.archive": b"1"}
    del meta[b"routing_replay.archive.crc32"]  # as version 1 wrote it: no metadata CRC
    old = rewrite("old.arrow", schema.with_metadata(meta), batches)
    with pytest.raises(
        CorruptArchiveError, match=r"not a route archive of version 2 \(it says version '1'\)"
    ):
        load_routes(old, dst)
    with pytest.raises(CorruptArchiveError, match="lists 5 record batches, its schema says 6"):
        load_routes(rewrite("short.arrow", schema, batches[:5]), dst)
    assert len(dst) == 0 and dst.stats().pages_used == 0


def test_the_crc_is_of_what_is_written_however_read_lays_out_its_arrays(stores, tmp_path):
    """`read` may return sliced arrays (offsets not 0) or, like a Ray fetch that reorders
    rows across stores (`take`), arrays with a validity bitmap and no nulls, which Arrow
    writes without it: each archive still loads, exactly."""
    src = stores(NARROW)
    first = src.put("first", NARROW.random_routes(np.random.default_rng(13), 5), token_ids=[7] * 5)
    refs = fill(src, np.random.default_rng(14))

    def sliced(chunk):
        return src.read([first, *chunk]).slice(1)

    def taken(chunk):
        batch = src.read(chunk)
        table = pa.Table.from_batches([batch, batch]).take(pa.array(np.arange(len(chunk))))
        return table.combine_chunks().to_batches()[0]

    for read in (sliced, taken):
        path = tmp_path / f"{read.__name__}.arrow"
        save_routes(path, refs, read=read, chunk_tokens=40)
        dst = stores(NARROW)
        new = load_routes(path, dst)
        assert dst.read(new).equals(src.read(refs)), read.__name__


def test_a_load_that_runs_out_of_room_leaves_the_store_as_it_was(stores, tmp_path):
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(5))
    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=src.read, chunk_tokens=40)  # several batches
    small = stores(NARROW, capacity_tokens=96)
    kept = small.put("kept", NARROW.random_routes(np.random.default_rng(6), 9))
    with pytest.raises(StoreFullError):
        load_routes(path, small, timeout=0)
    assert len(small) == 1 and kept in small
    assert small.stats().pages_used == 2


def test_a_failed_save_leaves_no_file(stores, tmp_path):
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(7))
    path = tmp_path / "routes.arrow"
    calls = []

    def read(chunk):
        calls.append(len(chunk))
        if len(calls) == 3:
            raise OSError("the store's node went away")
        return src.read(chunk)

    with pytest.raises(OSError, match="went away"):
        save_routes(path, refs, read=read, chunk_tokens=40)
    assert list(tmp_path.iterdir()) == []


def pa_file(f, schema):
    import pyarrow.ipc as ipc

    return ipc.new_file(f, schema)


def _load_and_die(name: str, path: str, at: int) -> None:
    """Load the archive into the store `name`; SIGKILL this process at its `at`-th lock point."""
    store, seen = RoutingStore.attach(name), []

    def die(point: str) -> None:
        seen.append(point)
        if len(seen) - 1 == at:
            os.kill(os.getpid(), signal.SIGKILL)

    with interleave(die):
        load_routes(path, store)
    os._exit(3)  # not reached


def test_a_loader_killed_at_any_point_loads_all_or_nothing(stores, tmp_path):
    src = stores(NARROW)
    refs = fill(src, np.random.default_rng(3))
    want = [src.get(r).tolist() for r in refs]
    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=src.read)
    points = []
    with interleave(points.append):
        load_routes(path, stores(NARROW))
    assert len(points) >= 6  # look up, reserve, publish: each taken and dropped
    for at in range(len(points)):
        dst = stores(NARROW)
        dst.put("kept", kept := NARROW.random_routes(np.random.default_rng(4), 30))
        child = mp.get_context("fork").Process(target=_load_and_die, args=(dst.name, path, at))
        child.start()
        child.join()
        assert child.exitcode == -signal.SIGKILL, points[at]
        loaded = [r.sample_id in dst for r in refs]
        assert not any(loaded) or all(loaded), f"killed at {points[at]}: {loaded}"
        assert np.array_equal(dst.get("kept"), kept)
        if all(loaded):
            assert [dst.get(r.sample_id).tolist() for r in refs] == want
        dst.reclaim()
        assert dst.stats().pages_pending == 0
        dst.verify()
        if not any(loaded):  # and the same archive loads after
            new = load_routes(path, dst)
            assert [dst.get(r).tolist() for r in new] == want
