"""The sample index: slots, their id buckets, the free-slot stack, and each sample's checksum.

A published sample is a slot: id, put serial, token count, prompt length, its last page
and chain length, the digest of its token ids, and a crc32 of all of that plus every page
of its chain *and that page's generation at publish*. A page of a published chain is never
reserved again while the sample holds it, so the checksum is the same at every read
unless the tables were broken: a wrong parent pointer, a page handed to another writer, a
flipped byte. Readers check it under the lock and raise `CorruptStoreError` rather than
return another sample's routes.

A publish holding fills the slots of all its samples, then raises the header's
`next_serial` past their serials: that is the commit point of a put (of one sample or
many). A holding cut short (its process killed, or an exception) leaves slots whose serial
is not below `next_serial`; repair frees them, so a batch is stored whole or not at all.
A release (of one sample or many) marks its slots RELEASING, then sets the header's
`releasing` flag: that is its commit point, so a release too is whole or not at all.
"""

from __future__ import annotations

import hashlib
import zlib

import numpy as np

from routing_replay.errors import StoreFullError
from routing_replay.store.format import (
    FIRST_SERIAL,
    FREE,
    NO_PAGE,
    NO_SERIAL,
    NOT_SPILLED,
    PUBLISHED,
    READ,
    RELEASING,
    TOKEN_DTYPE,
)
from routing_replay.store.lock import Hold
from routing_replay.store.tables import Tables, checked_index, unlink_from_chain

EMPTY = np.empty(0, dtype=np.int64)


def token_digest(token_ids: np.ndarray) -> int:
    """64-bit digest of a sample's token ids (as int32): what a ref carries (never NO_DIGEST)."""
    return token_digests([np.ascontiguousarray(token_ids, dtype=TOKEN_DTYPE)], [0])[0]


def token_digests(tokens: list[np.ndarray], prompt_lens: list[int]) -> list[int]:
    """`token_digest` of each sample's int32 token ids; a prompt that the sample before has
    too (GRPO's samples of one prompt) is hashed once, its hash state copied."""
    digests, prompt, state = [], EMPTY, None
    for ids, n in zip(tokens, prompt_lens, strict=True):
        if n <= 0 or state is None or not np.array_equal(prompt, ids[:n]):
            prompt, state = ids[: max(n, 0)], hashlib.blake2b(ids[: max(n, 0)], digest_size=8)
        hashed = state.copy()
        hashed.update(ids[len(prompt) :])
        digests.append(int.from_bytes(hashed.digest(), "little") | 1)
    return digests


def checksum(
    raw_id: bytes,
    serial: int,
    num_tokens: int,
    prompt_len: int,
    digest: int,
    chain: np.ndarray,
    gens: np.ndarray,
    mark: int,
    spill: int = NOT_SPILLED,
) -> int:
    """crc32 of a sample's fields, chain pages and their generations (a spilled sample: its
    spill field and no chain)."""
    fields = np.array([num_tokens, prompt_len, len(chain)], dtype="<i4").tobytes()
    words = np.array([digest, serial, spill, mark], dtype="<u8").tobytes()
    crc = zlib.crc32(fields + words + raw_id)
    crc = zlib.crc32(np.ascontiguousarray(chain, dtype="<i4"), crc)
    return zlib.crc32(np.ascontiguousarray(gens, dtype="<u4"), crc)


class SampleIndex:
    """Slots of one store, found by sample id in bounded bucket chains."""

    def __init__(self, tables: Tables) -> None:
        self._t = tables

    def _bucket(self, raw_id: bytes) -> int:
        return zlib.crc32(raw_id) % len(self._t.sample_heads)

    def find(self, raw_id: bytes) -> int:
        """The published slot of `raw_id`, or NO_PAGE (under the lock)."""
        t = self._t
        s = checked_index(t, t.sample_heads[self._bucket(raw_id)], t.max_samples, "bucket head")
        for _ in range(t.max_samples + 1):  # every slot in one chain, then its end
            if s == NO_PAGE:
                return NO_PAGE
            if t.s_state[s] == PUBLISHED and t.s_sample_id[s] == raw_id:
                return s
            s = checked_index(t, t.s_next[s], t.max_samples, f"slot {s}'s next")
        raise t.corrupt("a sample bucket chain loops")

    def sample_id(self, slot: int) -> bytes:
        """The raw id of a slot."""
        return bytes(self._t.s_sample_id[slot])

    def digest(self, slot: int) -> int:
        """The token digest of a slot (NO_DIGEST: put without token ids); `chain` checks it."""
        return int(self._t.s_digest[slot])

    def serial(self, slot: int) -> int:
        """The put serial of a slot; `chain` checks it."""
        return int(self._t.s_serial[slot])

    def mark(self, slot: int) -> int:
        """The mark its putter gave a slot (NO_MARK: none); `chain` checks it."""
        return int(self._t.s_mark[slot])

    def chain(self, slot: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(pages, their generations, num_tokens, prompt_len) of a published slot, every field
        (the digest too) range-checked and the checksum verified (under the lock)."""
        spill = self.spill(slot)
        if spill == NOT_SPILLED:
            return self.chain_in_memory(slot)
        t = self._t  # its routes are in its spill file
        tokens, prompt_len = int(t.s_num_tokens[slot]), int(t.s_prompt_len[slot])
        return self._checked(slot, EMPTY, EMPTY.astype(np.uint32), tokens, prompt_len, spill)

    def chain_in_memory(self, slot: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """`chain` of a slot whose routes are in pages, checked as put (also, for repair, of a
        spilled slot whose spill an interruption cut short before its checksum changed)."""
        t = self._t
        n, tokens = int(t.s_num_pages[slot]), int(t.s_num_tokens[slot])
        prompt_len = int(t.s_prompt_len[slot])
        if not (
            0 < n <= t.num_pages
            and (n - 1) * t.page_tokens < tokens <= n * t.page_tokens
            and -1 <= prompt_len <= tokens
        ):
            raise t.corrupt(f"slot {slot}: {tokens} tokens in {n} pages, prompt_len {prompt_len}")
        pages = np.empty(n, dtype=np.int64)
        p = int(t.s_last_page[slot])  # (no view in a local: a traceback would keep it)
        for i in range(n - 1, -1, -1):
            if not 0 <= p < t.num_pages:
                raise t.corrupt(f"slot {slot}: page {p} of its chain is out of range")
            pages[i] = p
            p = int(t.p_parent[p])
        if p != NO_PAGE:
            raise t.corrupt(f"slot {slot}: its chain's first page has a parent")
        return self._checked(slot, pages, t.p_gen[pages], tokens, prompt_len, NOT_SPILLED)

    def _checked(
        self,
        slot: int,
        pages: np.ndarray,
        gens: np.ndarray,
        tokens: int,
        prompt_len: int,
        spill: int,
    ) -> tuple[np.ndarray, np.ndarray, int, int]:
        t = self._t
        if not (tokens > 0 and -1 <= prompt_len <= tokens):
            raise t.corrupt(f"slot {slot}: {tokens} tokens, prompt_len {prompt_len}")
        raw_id, digest, serial = self.sample_id(slot), self.digest(slot), self.serial(slot)
        mark = self.mark(slot)
        check = checksum(raw_id, serial, tokens, prompt_len, digest, pages, gens, mark, spill)
        if check != int(t.s_check[slot]):
            raise t.corrupt(
                f"sample {raw_id.decode(errors='replace')!r} (slot {slot}) fails its checksum: "
                "its chain or a page generation changed after it was published"
            )
        return pages, gens, tokens, prompt_len

    def spill(self, slot: int) -> int:
        """NOT_SPILLED, or the code naming the slot's spill file; `chain` checks it."""
        return int(self._t.s_spill[slot])

    def mark_read(self, slots: list[int]) -> None:
        """Flag slots as read (under the lock, no write: a hint, never trusted)."""
        self._t.s_flags[slots] |= READ

    def free_count(self) -> int:
        """Slots on the free-slot stack (under the lock)."""
        return self._t.counter("free_slots", self._t.max_samples)

    def full_error(self, needed: int) -> StoreFullError:
        """The error for a put of `needed` samples into too few free slots."""
        t = self._t
        return StoreFullError(
            f"store {t.name!r} holds {t.max_samples - self.free_count()} of its maximum of "
            f"{t.max_samples} samples and a put needs {needed} more: release consumed "
            "samples, or create it with a larger max_samples"
        )

    def take_slot(self, hold: Hold) -> int:
        """Pop a free slot (under the lock); StoreFullError if every slot holds a sample."""
        t = self._t
        top = self.free_count()
        if top == 0:
            raise self.full_error(1)
        slot = checked_index(t, t.free_slots[top - 1], t.max_samples, "free slot")
        if slot == NO_PAGE or t.s_state[slot] != FREE:
            raise t.corrupt(f"the free-slot stack holds slot {slot}, which is not free")
        hold.write()
        t.hdr["free_slots"] = top - 1
        return slot

    def publish(
        self,
        slot: int,
        raw_id: bytes,
        serial: int,
        num_tokens: int,
        prompt_len: int,
        digest: int,
        chain: np.ndarray,
        gens: np.ndarray,
        mark: int,
    ) -> None:
        """Fill a taken slot and link it (inside a write); `commit` makes it stay."""
        t = self._t
        t.s_serial[slot] = serial
        t.s_mark[slot] = mark
        t.s_num_tokens[slot] = num_tokens
        t.s_prompt_len[slot] = prompt_len
        t.s_digest[slot] = digest
        t.s_last_page[slot] = chain[-1]
        t.s_num_pages[slot] = len(chain)
        t.s_sample_id[slot] = raw_id
        t.s_spill[slot] = NOT_SPILLED
        t.s_flags[slot] = 0
        t.s_check[slot] = checksum(
            raw_id, serial, num_tokens, prompt_len, digest, chain, gens, mark
        )
        b = self._bucket(raw_id)
        t.s_next[slot] = t.sample_heads[b]
        t.sample_heads[b] = slot
        t.s_state[slot] = PUBLISHED  # visible to readers once the holding commits
        t.add("samples", 1)
        t.add("tokens", num_tokens)
        t.add("pages_referenced", len(chain))

    def release(self, slots: list[int]) -> None:
        """Commit to removing published slots, all or none (inside a write): they become
        RELEASING, then one header write is the commit point; `remove` each, then `released`.
        Cut short, repair (`finish_release`) frees them all if the commit point was reached,
        else publishes them all again."""
        t = self._t
        t.s_state[slots] = RELEASING
        t.hdr["releasing"] = 1  # the commit point of the whole release

    def released(self) -> None:
        """Every slot of the committed release is removed (inside a write)."""
        self._t.hdr["releasing"] = 0

    def finish_release(self) -> int:
        """Repair: the slots of a release cut short, freed if it was committed, else published
        again; returns how many. Safe to stop and run again at any point."""
        t = self._t
        doomed = np.flatnonzero(t.s_state == RELEASING)
        t.s_state[doomed] = FREE if t.hdr["releasing"] else PUBLISHED
        t.hdr["releasing"] = 0
        return len(doomed)

    def remove(self, slot: int, raw_id: bytes, num_pages: int) -> None:
        """Free a slot of a committed release (inside a write)."""
        t = self._t
        t.s_state[slot] = FREE
        t.s_serial[slot] = NO_SERIAL  # a reader that located it sees the change
        t.s_spill[slot] = NOT_SPILLED
        t.add("samples", -1)
        t.add("tokens", -int(t.s_num_tokens[slot]))
        t.add("pages_referenced", -num_pages)
        unlink_from_chain(t, t.sample_heads, t.s_next, self._bucket(raw_id), slot, "slot")
        top = t.counter("free_slots", t.max_samples - 1)
        t.free_slots[top] = slot
        t.hdr["free_slots"] = top + 1

    def next_serial(self) -> int:
        """The serial the next put gets (under the lock)."""
        value = int(self._t.hdr["next_serial"])
        if value < FIRST_SERIAL:
            raise self._t.corrupt(f"header next_serial={value} is below {FIRST_SERIAL}")
        return value

    def commit(self, next_serial: int) -> None:
        """The commit point of a publish holding: every slot it filled, below `next_serial`,
        is now a stored sample (inside a write)."""
        self._t.hdr["next_serial"] = next_serial

    def roll_back_uncommitted(self) -> int:
        """Repair: free the slots a publish holding filled but never committed (their serial is
        not below `next_serial`); returns how many. Derived tables are rebuilt after."""
        t = self._t
        torn = (t.s_state == PUBLISHED) & (t.s_serial >= np.uint64(self.next_serial()))
        t.s_state[torn] = FREE
        return int(torn.sum())

    def published(self) -> np.ndarray:
        """Slots whose state is PUBLISHED."""
        return np.flatnonzero(self._t.s_state == PUBLISHED)

    def rebuild(self, published: np.ndarray, chains: list[np.ndarray]) -> None:
        """Repair: buckets, free-slot stack and counters from the published slots."""
        t = self._t
        t.sample_heads[:] = NO_PAGE
        for s in published.tolist():
            b = self._bucket(self.sample_id(s))
            t.s_next[s] = t.sample_heads[b]
            t.sample_heads[b] = s
        free = np.flatnonzero(t.s_state != PUBLISHED)
        t.s_state[free] = FREE
        t.s_serial[free] = NO_SERIAL
        t.s_spill[free] = NOT_SPILLED
        t.free_slots[: len(free)] = free[::-1]
        t.hdr["free_slots"] = len(free)
        t.hdr["samples"] = len(published)
        t.hdr["tokens"] = int(t.s_num_tokens[published].astype(np.int64).sum())
        t.hdr["pages_referenced"] = sum(len(c) for c in chains)
