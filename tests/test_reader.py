"""Arrow batches to torch: packed with cu_seqlens, padded left and right, alignment errors."""

from __future__ import annotations

import os
import uuid
import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch

from routing_replay import RoutingLayout, RoutingStore, cu_seqlens, to_torch
from routing_replay.errors import InvalidRoutesError, LayoutMismatchError
from routing_replay.schema import layout_of, routes_schema
from routing_replay.store.segment import segment_path

LAYOUT = RoutingLayout(3, 2, 8, (0, 2))


@pytest.fixture
def store():
    name = f"test-reader-{uuid.uuid4().hex[:8]}"
    with RoutingStore.create(name, LAYOUT, capacity_tokens=4096, page_tokens=8) as s:
        yield s
    assert not os.path.exists(segment_path(name))


def _routes(n: int, seed: int) -> np.ndarray:
    r = LAYOUT.random_routes(np.random.default_rng(seed), n)
    r[-1] = -1
    return r


def test_packed_and_padded(store):
    lengths = [5, 1, 12]
    samples = [_routes(n, i) for i, n in enumerate(lengths)]
    for i, r in enumerate(samples):
        store.put(f"s{i}", r, prompt_len=1)
    batch = store.read(["s0", "s1", "s2"])
    assert batch.schema.equals(routes_schema(LAYOUT), check_metadata=True)
    assert layout_of(batch) == LAYOUT

    packed = to_torch(batch)
    assert packed.dtype == torch.int8 and packed.shape == (18, 2, 2)
    assert cu_seqlens(batch).tolist() == [0, 5, 6, 18]
    assert torch.equal(packed, torch.from_numpy(np.concatenate(samples)).to(torch.int8))

    S = 14
    right = torch.zeros(3, S, dtype=torch.bool)
    left = torch.zeros(3, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        right[b, :n] = True
        left[b, S - n :] = True
    for mask in (right, left):
        padded = to_torch(batch, mask)
        assert padded.shape == (3, S, 2, 2)
        assert (padded[~mask] == -1).all()
        for b, r in enumerate(samples):
            assert torch.equal(padded[b][mask[b]].long(), torch.from_numpy(r))

    # Completion-only reads line up with a completion mask.
    comp = store.read(["s0", "s2"], part="completion")
    assert comp.column("num_tokens").to_pylist() == [4, 11]
    assert torch.equal(to_torch(comp)[:4].long(), torch.from_numpy(samples[0][1:]))


def test_sliced_and_chunked_batches(store):
    samples = [_routes(n, i) for i, n in enumerate([3, 7, 2, 9])]
    for i, r in enumerate(samples):
        store.put(f"s{i}", r)
    batch = store.read([f"s{i}" for i in range(4)])
    tail = batch.slice(1, 2)
    assert torch.equal(to_torch(tail).long(), torch.from_numpy(np.concatenate(samples[1:3])))
    table = pa.Table.from_batches([batch.slice(0, 2), batch.slice(2, 2)])
    assert torch.equal(to_torch(table).long(), torch.from_numpy(np.concatenate(samples)))
    assert cu_seqlens(table).tolist() == [0, 3, 10, 12, 21]


def test_misaligned_mask_is_refused(store):
    store.put("a", _routes(4, 0))
    store.put("b", _routes(3, 1))
    batch = store.read(["a", "b"])
    good = torch.tensor([[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert to_torch(batch, good).shape == (2, 5, 2, 2)
    with pytest.raises(InvalidRoutesError, match="row 1 of attention_mask has 4 tokens"):
        to_torch(batch, torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]))
    with pytest.raises(InvalidRoutesError, match="contiguous"):
        to_torch(batch, torch.tensor([[1, 1, 0, 1, 1], [0, 0, 1, 1, 1]]))
    with pytest.raises(InvalidRoutesError, match="attention_mask must be"):
        to_torch(batch, good[:1])
    with pytest.raises(LayoutMismatchError, match="no routing layout metadata"):
        to_torch(batch.replace_schema_metadata(None))


def test_wide_layout_widens_once(store):
    layout = RoutingLayout(2, 2, 200)  # uint8 storage, ids above 127 need int16
    name = f"test-reader-wide-{uuid.uuid4().hex[:8]}"
    with RoutingStore.create(name, layout, capacity_tokens=64) as wide:
        r = np.array([[[199, 0], [-1, -1]], [[150, 3], [7, 128]]])
        wide.put("w", r)
        t = to_torch(wide.read(["w"]))
        assert t.dtype == torch.int16 and torch.equal(t.long(), torch.from_numpy(r))


def test_read_into_reused_memory(store):
    samples = [_routes(n, i) for i, n in enumerate([3, 7, 2, 9])]
    for i, r in enumerate(samples):
        store.put(f"s{i}", r)
    bpt = LAYOUT.bytes_per_token
    out = torch.empty(21 * bpt + 5, dtype=torch.uint8)  # a trainer's buffer, a bit larger
    # Two reads into consecutive slices of one buffer (refs arriving in two groups).
    first = store.read(["s0", "s1"], out=out)
    second = store.read(["s2", "s3"], out=out[10 * bpt :])
    packed = to_torch(pa.Table.from_batches([first, second]))
    assert torch.equal(packed.long(), torch.from_numpy(np.concatenate(samples)))
    assert packed.data_ptr() == out.data_ptr()  # a view of `out`: no copy anywhere
    # Batches in separate memory are concatenated (a copy), in the table's order.
    apart = pa.Table.from_batches([store.read(["s2", "s3"]), store.read(["s0"])])
    expected = np.concatenate([samples[2], samples[3], samples[0]])
    assert torch.equal(to_torch(apart).long(), torch.from_numpy(expected))
    # Memory that cannot take the batch is refused before anything is copied.
    with pytest.raises(ValueError, match=f"at least {21 * bpt} bytes"):
        store.read([f"s{i}" for i in range(4)], out=bytearray(21 * bpt - 1))
    frozen = np.zeros(100, dtype=np.uint8)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="writable=False"):
        store.read(["s0"], out=frozen)
    with pytest.raises(ValueError, match="contiguous=False"):
        store.read(["s0"], out=np.zeros((10, 20), dtype=np.uint8)[:, ::2])
    assert torch.equal(to_torch(store.read(["s1"])).long(), torch.from_numpy(samples[1]))


def test_a_tensor_never_writes_into_memory_it_does_not_own(store):
    # A batch that arrived read-only (an IPC stream, Ray's object store) is copied by
    # to_torch: writing to the tensor changes neither the batch nor what others read, and
    # torch warns of nothing. A batch this process read itself is viewed, no copy.
    refs = [store.put(f"s{i}", _routes(6, i)) for i in range(3)]
    local = store.read(refs)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, local.schema) as writer:
        writer.write_batch(local)
    received = pa.ipc.open_stream(pa.py_buffer(sink.getvalue().to_pybytes())).read_next_batch()
    assert not received.column("routed_experts").flatten().flatten().buffers()[1].is_mutable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "The given NumPy array is not writable" would raise
        tensor = to_torch(received)
    before = received.column("routed_experts").to_pylist()
    tensor.fill_(3)
    assert received.column("routed_experts").to_pylist() == before
    assert to_torch(received).tolist() != tensor.tolist()
    own = to_torch(local)  # this process's own read: a view of its buffer
    values = local.column("routed_experts").flatten().flatten()
    assert own.data_ptr() == values.buffers()[1].address + values.offset


def test_an_empty_sequence_dimension_is_a_batch_of_empty_rows(store):
    """Rows read with no tokens against a `[B, 0]` mask: `[B, 0, L, K]` (before: a raw
    IndexError from the mask's argmax)."""
    refs = [store.put(sid, LAYOUT.random_routes(np.random.default_rng(7), 4)) for sid in "ab"]
    batch = store.read(refs, ranges=[(0, 0), (2, 2)])
    padded = to_torch(batch, attention_mask=torch.ones(2, 0))
    assert tuple(padded.shape) == (2, 0, LAYOUT.num_moe_layers, LAYOUT.top_k)
