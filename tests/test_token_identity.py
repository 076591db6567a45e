"""Token identity end to end: routes are only ever used for the tokens they were recorded for.

The store keeps each sample's token ids (and a digest the ref carries); `to_torch(input_ids=)`
and `attach_routes` compare every trained token with them, and a stale ref (its sample id
released and put again with other tokens) is refused.
"""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest
import torch

from routing_replay import RoutingLayout, RoutingStore, to_torch
from routing_replay.errors import (
    CorruptStoreError,
    InvalidArgumentError,
    InvalidRoutesError,
    SampleReplacedError,
    TokenMismatchError,
)
from routing_replay.integrations.nemo_rl import attach_routes
from routing_replay.store import prefix, token_digest

LAYOUT = RoutingLayout(num_layers=3, moe_layers=(0, 2), num_experts=8, top_k=2)


@pytest.fixture
def store():
    with RoutingStore.create(f"test-tok-{uuid.uuid4().hex[:8]}", LAYOUT, 4096, page_tokens=4) as s:
        yield s


def _sample(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return LAYOUT.random_routes(rng, n).astype(np.int32), rng.integers(3, 50_000, n)


def test_read_returns_the_token_ids_put_with_the_routes(store):
    rng = np.random.default_rng(0)
    routes, tokens = _sample(rng, 10)
    ref = store.put("a", routes, prompt_len=3, token_ids=tokens)
    store.put("b", routes)  # without tokens: null in the column
    assert ref.tokens_digest == token_digest(tokens) != 0
    batch = store.read([ref, "b"])
    assert batch.column("token_ids").to_pylist() == [tokens.tolist(), None]
    assert store.read([ref], part="completion").column("token_ids").to_pylist() == [
        tokens[3:].tolist()
    ]
    assert store.read([ref], part="prompt").column("token_ids").to_pylist() == [tokens[:3].tolist()]


def test_to_torch_checks_every_token_padded_and_packed(store):
    rng = np.random.default_rng(1)
    (r0, t0), (r1, t1) = _sample(rng, 5), _sample(rng, 7)
    refs = [store.put("s0", r0, token_ids=t0), store.put("s1", r1, token_ids=t1)]
    batch = store.read(refs)
    # Left padding to width 8.
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 3:], mask[1, 1:] = True, True
    input_ids = torch.zeros(2, 8, dtype=torch.long)
    input_ids[0, 3:], input_ids[1, 1:] = torch.from_numpy(t0), torch.from_numpy(t1)
    padded = to_torch(batch, attention_mask=mask, input_ids=input_ids)
    assert torch.equal(padded[1, 1:], torch.from_numpy(r1).to(padded.dtype))
    packed = torch.from_numpy(np.concatenate([t0, t1]))
    assert torch.equal(to_torch(batch, input_ids=packed), to_torch(batch))
    assert torch.equal(to_torch(batch, input_ids=packed[None]), to_torch(batch))

    # The same text re-tokenised to the same length: one token differs in sample s1.
    retokenised = input_ids.clone()
    retokenised[1, 5] = int(t1[4]) + 1
    with pytest.raises(TokenMismatchError) as e:
        to_torch(batch, attention_mask=mask, input_ids=retokenised)
    assert str(e.value) == (
        f"sample 's1': the trainer's token at position 4 (column 5 of row 1) is {int(t1[4]) + 1} "
        f"but the routes were recorded for token {int(t1[4])} (1 of its 7 tokens differ, 1 in "
        "the batch): the training batch does not hold the rollout's tokens (text re-tokenised, "
        "e.g. a chat template applied again, or rows reordered). Train on the token ids the "
        "rollout returned"
    )
    swapped = torch.from_numpy(np.concatenate([t1[:5], t0, t1[5:]]))  # rows in another order
    with pytest.raises(TokenMismatchError, match=r"sample 's0': .* position 0 \(token 0 of"):
        to_torch(batch, input_ids=swapped)
    with pytest.raises(InvalidRoutesError, match=r"packed input_ids must be \[sum_T=12\]"):
        to_torch(batch, input_ids=packed[:-1])
    # One sample of one token: [1] and [1, 1] are the packed shapes (a squeeze made a scalar).
    one = store.read([store.put("one", r0[:1], token_ids=t0[:1])])
    for ids in (torch.from_numpy(t0[:1]), torch.from_numpy(t0[:1])[None]):
        assert torch.equal(to_torch(one, input_ids=ids), to_torch(one))


def test_samples_put_without_tokens_cannot_be_checked(store):
    rng = np.random.default_rng(2)
    routes, tokens = _sample(rng, 6)
    batch = store.read([store.put("bare", routes)])
    with pytest.raises(InvalidRoutesError, match="sample 'bare' was put without token_ids"):
        to_torch(batch, input_ids=torch.from_numpy(tokens))
    assert to_torch(batch).shape == (6, 2, 2)  # unchecked reads still work


def test_a_stale_ref_is_refused_after_its_id_is_put_again(store):
    rng = np.random.default_rng(3)
    routes, tokens = _sample(rng, 9)
    old = store.put("s", routes, token_ids=tokens)
    store.release([old])
    other = tokens.copy()
    other[2] += 1
    new = store.put("s", routes, token_ids=other)
    with pytest.raises(SampleReplacedError, match=r"'s' through this ref: it names put #1"):
        store.read([old])
    with pytest.raises(SampleReplacedError):
        store.get(old)
    # A hand-made ref (no serial) is still told apart by its tokens.
    unchecked = dataclasses.replace(old, serial=0)
    with pytest.raises(SampleReplacedError, match=r"ref 's' .* was released and put again"):
        store.read([unchecked])
    assert store.read([new]).column("token_ids").to_pylist() == [other.tolist()]
    # By id (no ref) the current sample is read, as before.
    assert store.read(["s"]).column("token_ids").to_pylist() == [other.tolist()]


def test_sharing_needs_equal_tokens_even_when_page_keys_collide(store, monkeypatch):
    rng = np.random.default_rng(4)
    routes, tokens = _sample(rng, 8)
    other = tokens.copy()
    other[1] += 1  # first page differs by one token, routes equal
    monkeypatch.setattr(prefix, "page_keys", lambda tokens_NP: [7] * len(tokens_NP))
    monkeypatch.setattr("routing_replay.store.put.page_keys", prefix.page_keys)
    store.put("x", routes, token_ids=tokens)
    assert store.stats().pages_used == 2
    store.put("y", routes, token_ids=other)
    assert store.stats().pages_used == 4  # nothing shared: the keys collided, tokens differ
    store.put("z", routes, token_ids=tokens)
    assert store.stats().pages_used == 4  # equal tokens and routes: both pages shared
    got = store.read(["x", "y", "z"]).column("token_ids").to_pylist()
    assert got == [tokens.tolist(), other.tolist(), tokens.tolist()]
    store.verify()


def test_the_checksum_covers_the_digest(store):
    rng = np.random.default_rng(5)
    routes, tokens = _sample(rng, 5)
    store.put("d", routes, token_ids=tokens)
    core = store._core
    core.tables.s_digest[core.samples.find(b"d")] ^= 2  # a flipped bit in shared memory
    with pytest.raises(CorruptStoreError, match="fails its checksum"):
        store.read(["d"])


def test_bad_token_ids_are_refused_and_nothing_is_stored(store):
    rng = np.random.default_rng(6)
    routes, tokens = _sample(rng, 5)
    bad_range = r"sample 'n': token ids must be in \[0, 2\*\*31\)"
    with pytest.raises(InvalidArgumentError, match=bad_range):
        store.put("n", routes, token_ids=np.array([1, 2, -3, 4, 5]))
    with pytest.raises(InvalidArgumentError, match="one id per routes row"):
        store.put("n", routes, token_ids=tokens[:4])
    assert len(store) == 0 and store.stats().pages_used == 0


def test_attach_routes_refuses_a_retokenised_row(store):
    rng = np.random.default_rng(7)
    (r0, t0), (r1, t1) = _sample(rng, 4), _sample(rng, 6)
    refs = [store.put("p0", r0, token_ids=t0), store.put("p1", r1, token_ids=t1)]
    input_ids = torch.zeros(2, 7, dtype=torch.long)
    input_ids[0, :4], input_ids[1, :6] = torch.from_numpy(t0), torch.from_numpy(t1)
    batch = {"input_ids": input_ids, "input_lengths": torch.tensor([4, 6]), "routing_refs": refs}
    attach_routes(dict(batch), fetch=store.read)  # the rollout's own tokens: fine
    batch["input_ids"] = input_ids.clone()
    batch["input_ids"][0, 3] += 1
    with pytest.raises(TokenMismatchError, match=r"sample 'p0': .* position 3 \(column 3 of row 0"):
        attach_routes(batch, fetch=store.read)
