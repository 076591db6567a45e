"""The store segment's format: every constant, record type and region, in one place.

Segment layout (every region 64-byte aligned):

    header | page table [num_pages] | page buckets | free-page stack [num_pages] |
    slot table [max_samples] | sample buckets | free-slot stack [max_samples] |
    writer leases [max_writers] | page tokens [num_pages, page_tokens] (int32) |
    page data [num_pages, page_tokens * L * K] (narrow dtype)

Byte-range locks at `LEASE_BASE` and up (past the end of any segment: a lock needs no
data under it) are the leases: the owner's at `OWNER_LEASE`, writer i's at
`WRITER_LEASE + i`.
"""

from __future__ import annotations

import numpy as np

MAGIC = b"RRSTORE1"
VERSION = 10  # 3: kernel leases, free stacks, checksums, store uid; 4: token ids; 5: put serials;
# 6: spill to disk; 7: a release of several samples commits at one point; 8: put/read timings;
# 9: the owner marks a store it removes; 10: a put's mark in its slot
ALIGN = 64
HEADER_BYTES = 4096
MAX_SAMPLE_ID_BYTES = 128
FORBIDDEN_ID_CHARS = "/\\\x00"
MAX_PAGE_TOKENS = 1 << 16
MAX_TABLE = 2**31 - 2  # pages, slots and buckets are int32 indices
DEFAULT_PAGE_TOKENS = 128
DEFAULT_PUT_TIMEOUT_S = 30.0
DEFAULT_MAX_WRITERS = 1024
MIN_LOCK_WAIT_S = 1.0  # a put with timeout=0 still waits this long for the lock
MAX_WAIT_S = 1e8  # the longest wait (3 years): `inf` means this
CHECK_CHUNK_BYTES = 1 << 18  # put copies and checks ids in chunks that stay in L2
ATTACH_WAIT_S = 5.0

LEASE_BASE = 1 << 40
OWNER_LEASE = LEASE_BASE
WRITER_LEASE = LEASE_BASE + 1

NO_PAGE = -1  # also "no slot" and "end of a bucket chain"
NO_OWNER = 0  # page owner field: 0, or writer lease index + 1
FREE, PUBLISHED, RELEASING = 0, 1, 2  # slot states (RELEASING: only inside a release holding)
LEASE_FREE, LEASE_HELD = 0, 1  # lease record states
NO_DIGEST = 0  # a sample put without token ids
FIRST_SERIAL = 1  # serials start here
NO_SERIAL = 0  # on a ref: the put is not checked (made by hand); in a slot: a free slot
TOKEN_DTYPE = np.dtype("<i4")  # token ids as stored, read and compared
MAX_SPILL_DIR_BYTES = 1024
READ = 1  # slot flag: read since put. A hint for the spill order, set without the dirty flag
NO_MARK = 0  # slot mark field: put without one
NOT_SPILLED = 0  # slot spill field: the routes are in the segment's pages

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("dirty", "<u4"),  # a locker is changing the tables; the next one repairs them
        ("page_tokens", "<i8"),
        ("num_pages", "<i8"),
        ("max_samples", "<i8"),
        ("page_buckets", "<i8"),
        ("sample_buckets", "<i8"),
        ("max_writers", "<i8"),
        ("store_uid", "<u8"),  # random per store: refs of another incarnation are refused
        ("owner_pid", "<i8"),  # informational: a pid means nothing in another namespace
        ("created", "<f8"),
        ("free_pages", "<i8"),  # entries in the free-page stack
        ("free_slots", "<i8"),  # entries in the free-slot stack
        ("samples", "<i8"),  # published samples
        ("tokens", "<i8"),  # their tokens
        ("pages_used", "<i8"),  # pages with refcount > 0
        ("pages_reserved", "<i8"),  # pages reserved by writers, not yet published
        ("pages_referenced", "<i8"),  # sum of the published samples' chain lengths
        # Serial of the next put. Raising it is the commit point of a publish holding: a
        # slot whose serial is not below it was published by a holding that never ended.
        ("next_serial", "<u8"),
        ("spill_budget", "<i8"),  # bytes of spill files allowed; 0: the store does not spill
        ("spilled", "<i8"),  # published samples whose routes are in a spill file
        ("spilled_bytes", "<i8"),  # the size of their files
        # Set inside a release holding once its slots are all RELEASING: the commit point of
        # the release. Repair frees RELEASING slots if it is set, else publishes them again.
        ("releasing", "<u4"),
        # A hint, set without the dirty flag: spill files no sample names may be left (a
        # releaser or spiller died before removing them); the next spill's `clean` looks.
        ("spill_garbage", "<u4"),
        # Set by the owner's unlink before the file goes: a segment gone from /dev/shm without
        # it (a wipe) while its owner lives is still served by the owner, and takes puts.
        ("unlinked", "<u4"),
        # Statistics for operators, set under the lock without the dirty flag (nothing is
        # derived from them): puts and reads of every process, and their time in ns.
        ("puts", "<u8"),
        ("put_ns", "<u8"),
        ("reads", "<u8"),
        ("read_ns", "<u8"),
        ("node_id", "S128"),
        ("layout", "S2048"),
        ("spill_dir", f"S{MAX_SPILL_DIR_BYTES}"),  # this store's own directory of spill files
    ]
)
PAGE_DTYPE = np.dtype(
    [
        ("refcount", "<i4"),  # published samples whose chain holds this page
        ("owner", "<i4"),  # writer lease index + 1 while reserved, NO_OWNER otherwise
        ("parent", "<i4"),  # page of the previous tokens, NO_PAGE for a first page
        ("next", "<i4"),  # next page in the same key bucket
        ("gen", "<u4"),  # bumped at every reservation: reuse is visible to everyone
        ("owner_gen", "<u4"),  # generation of the writer lease that reserved it
        ("key", "<u8"),  # hash of the page's token ids; 0 = not shareable
    ]
)
SLOT_DTYPE = np.dtype(
    [
        ("state", "<u4"),
        ("next", "<i4"),  # next slot in the same sample-id bucket
        ("num_tokens", "<i4"),
        ("prompt_len", "<i4"),  # -1 when unknown
        ("last_page", "<i4"),
        ("num_pages", "<i4"),
        ("check", "<u4"),  # crc32 of the fields, the chain's pages and generations
        ("flags", "<u4"),  # READ; a hint only: not in the checksum, never trusted
        ("digest", "<u8"),  # token_digest of the sample's token ids; NO_DIGEST: put without
        ("serial", "<u8"),  # the put's serial: refs name it, a re-put of the id gets another
        # NOT_SPILLED, or the routes are in this store's spill file `spill_name(serial, spill)`
        # (the writer that spilled them): setting it is the commit point of a spill.
        ("spill", "<u8"),
        # NO_MARK, or the putter's own random mark: after a stop, `Episode` tells its put
        # from another's of the same id by it.
        ("mark", "<u8"),
        ("sample_id", f"S{MAX_SAMPLE_ID_BYTES}"),
    ]
)
LEASE_DTYPE = np.dtype(
    [
        ("state", "<u4"),
        ("gen", "<u4"),  # bumped each time a process takes the lease
        ("pid", "<i4"),  # informational, in the holder's pid namespace
        ("spare", "<u4"),
        ("since", "<f8"),
    ]
)


def aligned(n: int) -> int:
    """`n` rounded up to the region alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pow2_at_least(n: int) -> int:
    """Smallest power of two >= n (at least 2)."""
    return 1 << max(int(n) - 1, 1).bit_length()


def regions(
    bytes_per_token: int,
    page_tokens: int,
    num_pages: int,
    max_samples: int,
    page_buckets: int,
    sample_buckets: int,
    max_writers: int,
) -> dict[str, int]:
    """Offset of every region, and `end`: the segment's size."""
    sizes = [
        ("pages", num_pages * PAGE_DTYPE.itemsize),
        ("page_heads", page_buckets * 4),
        ("free_pages", num_pages * 4),
        ("slots", max_samples * SLOT_DTYPE.itemsize),
        ("sample_heads", sample_buckets * 4),
        ("free_slots", max_samples * 4),
        ("leases", max_writers * LEASE_DTYPE.itemsize),
        ("tokens", num_pages * page_tokens * TOKEN_DTYPE.itemsize),
        ("data", num_pages * page_tokens * bytes_per_token),
    ]
    offsets, pos = {}, HEADER_BYTES
    for name, size in sizes:
        offsets[name] = pos
        pos = aligned(pos + size)
    offsets["end"] = pos
    return offsets
