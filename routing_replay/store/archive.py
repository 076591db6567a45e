"""Routes that outlive the store: save refs' samples to an Arrow IPC file, load them back.

A route archive is one Arrow IPC *file* (footer and all: a truncated file does not open):
the routes schema (`routing_replay.schema`, the layout in its metadata) plus each sample's
policy-version spans, token digest and put serial; every record batch carries a CRC-32 of
its buffers in its custom metadata. `save_routes` streams: it reads `chunk_tokens` tokens
at a time (reading the next chunk while a thread checksums and writes the last), so saving
10 GB needs two chunks of memory; it writes to a temporary name and renames, so a crash
never leaves a partial archive under the name. `load_routes` checks the layout and the
refs asked for first (reading only the id columns), then every batch's CRC, then puts all
its samples with one `put_many` (the routes are views of the memory-mapped file), so a
load is all or nothing, even if the loading process dies in the middle. Old refs map to
new ones by sample id, checked against the saved serial and token digest (a ref of
another put of that id is refused).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from routing_replay.errors import (
    CorruptArchiveError,
    InvalidArgumentError,
    LayoutMismatchError,
    SampleNotFoundError,
    SampleReplacedError,
)
from routing_replay.reader import stored_ids
from routing_replay.schema import (
    NUM_TOKENS,
    PROMPT_LEN,
    SAMPLE_ID,
    TOKEN_IDS,
    layout_of,
    routes_schema,
)
from routing_replay.store.format import NO_DIGEST
from routing_replay.store.refs import PutRequest, RoutingRef
from routing_replay.store.samples import token_digest

if TYPE_CHECKING:
    from routing_replay.layout import RoutingLayout
    from routing_replay.store.routing_store import RoutingStore

ARCHIVE_KEY = b"routing_replay.archive"  # schema metadata: the archive format's version
ARCHIVE_VERSION = b"1"
CRC_KEY = b"crc32"  # record batch metadata: CRC-32 of the batch's buffers
POLICY_VERSIONS, TOKENS_DIGEST, SERIAL = "policy_versions", "tokens_digest", "serial"
DEFAULT_CHUNK_TOKENS = 1 << 18  # tokens read and written at a time (~100 MB of Qwen3 routes)
SPANS = pa.list_(pa.struct([("start", pa.int64()), ("version", pa.int64())]))


def archive_schema(layout: RoutingLayout) -> pa.Schema:
    """The routes schema plus each sample's spans, digest and serial; versioned metadata."""
    base = routes_schema(layout)
    extra = [
        pa.field(POLICY_VERSIONS, SPANS, nullable=False),
        pa.field(TOKENS_DIGEST, pa.uint64(), nullable=False),
        pa.field(SERIAL, pa.uint64(), nullable=False),
    ]
    schema = pa.schema([*base, *extra], metadata=base.metadata)
    return schema.with_metadata({**schema.metadata, ARCHIVE_KEY: ARCHIVE_VERSION})


def batch_crc(batch: pa.RecordBatch) -> int:
    """CRC-32 over every buffer of every column, in order (validity, offsets, values)."""
    crc = 0
    for column in batch.columns:
        for buf in column.buffers():
            if buf is not None:
                crc = zlib.crc32(memoryview(buf), crc)
    return crc


def save_routes(
    path: str | os.PathLike,
    refs: Sequence[RoutingRef],
    *,
    read: Callable[[list[RoutingRef]], pa.RecordBatch],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> int:
    """Save the refs' samples to the archive `path`; returns the bytes written.

    `read(refs)` returns their Arrow batch (`store.read` in one process,
    `routing_replay.ray.fetch_batch` on Ray). Samples are read and written `chunk_tokens`
    tokens at a time; the file appears under `path` only once complete (fsynced).
    """
    refs = list(refs)
    if not refs or not all(isinstance(r, RoutingRef) for r in refs):
        raise InvalidArgumentError("save_routes needs a non-empty list of RoutingRefs")
    if len({r.sample_id for r in refs}) != len(refs):
        raise InvalidArgumentError("save_routes names a sample more than once")
    if chunk_tokens < 1:
        raise InvalidArgumentError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    path = os.fspath(path)
    tmp = f"{path}.partial-{os.getpid()}"
    try:
        with open(tmp, "wb") as f, ThreadPoolExecutor(1, "save_routes") as pool:
            writer, pending = None, None
            # Two stages, two chunks in flight: read the next chunk here while a thread
            # checksums and writes the last (zlib and Arrow's file writes release the GIL).
            for chunk in _chunks(refs, chunk_tokens):
                batch = _archive_batch(read(chunk), chunk)
                if pending is not None:
                    pending.result()
                writer = writer or ipc.new_file(f, batch.schema)
                pending = pool.submit(_write, writer, batch)
            pending.result()
            writer.close()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path) or ".")  # the rename itself survives a power cut
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return os.path.getsize(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(writer: Any, batch: pa.RecordBatch) -> None:
    """Append `batch` with its CRC."""
    writer.write_batch(batch, custom_metadata={CRC_KEY: str(batch_crc(batch))})


def _chunks(refs: list[RoutingRef], chunk_tokens: int) -> Iterator[list[RoutingRef]]:
    chunk: list[RoutingRef] = []
    tokens = 0
    for ref in refs:
        if chunk and tokens + ref.num_tokens > chunk_tokens:
            yield chunk
            chunk, tokens = [], 0
        chunk.append(ref)
        tokens += ref.num_tokens
    yield chunk


def _archive_batch(batch: pa.RecordBatch, refs: list[RoutingRef]) -> pa.RecordBatch:
    """A read's batch with the refs' spans, digests and serials added (checked to match)."""
    if batch.column(SAMPLE_ID).to_pylist() != [r.sample_id for r in refs]:
        raise InvalidArgumentError("read(refs) must return the refs' samples, in order")
    counts = batch.column(NUM_TOKENS).to_pylist()
    if counts != [r.num_tokens for r in refs]:
        raise InvalidArgumentError(f"read(refs) returned {counts} tokens, the refs hold others")
    spans = [[{"start": s, "version": v} for s, v in r.policy_versions] for r in refs]
    schema = archive_schema(layout_of(batch))
    columns = [
        *batch.columns,
        pa.array(spans, type=SPANS),
        pa.array([r.tokens_digest for r in refs], type=pa.uint64()),
        pa.array([r.serial for r in refs], type=pa.uint64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class RouteArchive:
    """An archive opened for reading (memory-mapped): its layout, samples and batches, each
    batch checked against its CRC as it is read."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        try:
            self._reader = ipc.open_file(pa.memory_map(self.path))
        except (pa.ArrowInvalid, OSError) as e:
            raise CorruptArchiveError(
                f"{self.path} is not a complete route archive ({e}): truncated or not written "
                "by save_routes; save the routes again from their store"
            ) from None
        schema = self._reader.schema
        if (schema.metadata or {}).get(ARCHIVE_KEY) != ARCHIVE_VERSION:
            raise CorruptArchiveError(
                f"{self.path} is an Arrow file but not a route archive of version "
                f"{ARCHIVE_VERSION.decode()}: write it with routing_replay.save_routes"
            )
        self.layout = layout_of(schema)

    def batches(self) -> Iterator[pa.RecordBatch]:
        """Every record batch, after its CRC check."""
        for i in range(self._reader.num_record_batches):
            batch, meta = self._batch(i, with_metadata=True)
            want = (meta or {}).get(CRC_KEY)
            if want is None or int(want) != batch_crc(batch):
                raise CorruptArchiveError(
                    f"record batch {i} of {self.path} fails its CRC check: the file was "
                    "damaged after it was written; nothing was loaded"
                )
            yield batch

    def _batch(self, i: int, with_metadata: bool = False) -> Any:
        try:
            batch, meta = self._reader.get_batch_with_custom_metadata(i)
        except (pa.ArrowInvalid, OSError) as e:
            raise CorruptArchiveError(
                f"record batch {i} of {self.path} does not read ({e}); nothing was loaded"
            ) from None
        return (batch, meta) if with_metadata else batch

    def check(self, layout: RoutingLayout, refs: Sequence[RoutingRef] | None) -> None:
        """The layout, and the refs asked for against the samples' ids, serials and digests
        (only those columns are read). Raises before anything is loaded (`load_routes` then
        checks every batch's CRC before its one put)."""
        if layout != self.layout:
            raise LayoutMismatchError(
                f"{self.path} holds routes of {self.layout}, the store is for {layout}: load "
                "it into a store of the archive's layout"
            )
        if refs is not None and not refs:
            return
        saved: dict[str, tuple[int, int, int]] = {}
        for i in range(self._reader.num_record_batches):
            batch = self._batch(i)
            ids = batch.column(SAMPLE_ID).to_pylist()
            for sid, n, digest, serial in zip(
                ids,
                batch.column(NUM_TOKENS).to_pylist(),
                batch.column(TOKENS_DIGEST).to_pylist(),
                batch.column(SERIAL).to_pylist(),
                strict=True,
            ):
                if sid in saved:
                    raise CorruptArchiveError(f"{self.path} holds sample {sid!r} twice")
                saved[sid] = (n, digest, serial)
        for ref in refs or ():
            if ref.sample_id not in saved:
                raise SampleNotFoundError(
                    f"sample {ref.sample_id!r} is not in {self.path}: it was not saved "
                    "there; nothing was loaded"
                )
            if (ref.num_tokens, ref.tokens_digest, ref.serial) != saved[ref.sample_id]:
                raise SampleReplacedError(
                    f"ref {ref.sample_id!r} names another put of that id than the one saved "
                    f"in {self.path}; nothing was loaded"
                )


def load_routes(
    path: str | os.PathLike,
    store: RoutingStore,
    refs: Sequence[RoutingRef] | None = None,
    *,
    timeout: float | None = None,
) -> list[RoutingRef]:
    """Put the archive's samples (or those of `refs`, the old refs) into `store`, all or
    nothing; returns the new refs, in file order (or aligned with `refs`; `[]` loads
    nothing)."""
    archive = RouteArchive(path)
    archive.check(store.layout, refs)  # for `refs=[]`, the layout only
    if refs is not None and not refs:
        return []
    wanted = None if refs is None else {r.sample_id for r in refs}
    # Every batch's CRC and every sample's token ids first, then one put_many: a bad file
    # never reaches the store, and the whole load is one commit in it, so not even a crash
    # of this process half-loads it. The routes are views of the memory-mapped file: the
    # requests cost no memory.
    requests = [
        r for batch in archive.batches() for r in _requests(batch, archive.layout)
        if wanted is None or r[0] in wanted
    ]  # fmt: skip
    for sid, request, digest in requests:  # the file's token ids must hash to their digest
        ids = request.token_ids
        if digest != (NO_DIGEST if ids is None else token_digest(ids)):
            raise CorruptArchiveError(
                f"sample {sid!r} of {archive.path}: its token ids do not match the digest "
                "saved with them; nothing was loaded"
            )
    loaded = store.put_many([r[1] for r in requests], timeout=timeout)
    if refs is None:
        return loaded
    by_id = {r.sample_id: r for r in loaded}
    return [by_id[r.sample_id] for r in refs]


def _requests(batch: pa.RecordBatch, layout: RoutingLayout) -> Iterator[tuple[str, Any, int]]:
    """(sample id, PutRequest, saved digest) of each row."""
    L, K = layout.num_moe_layers, layout.top_k
    routes = stored_ids(batch, layout).reshape(-1, L, K)  # narrow, as put stores them
    offsets = np.concatenate([[0], np.cumsum(batch.column(NUM_TOKENS).to_numpy())])
    tokens = batch.column(TOKEN_IDS)
    for i, (sid, prompt, spans, digest) in enumerate(
        zip(
            batch.column(SAMPLE_ID).to_pylist(),
            batch.column(PROMPT_LEN).to_pylist(),
            batch.column(POLICY_VERSIONS).to_pylist(),
            batch.column(TOKENS_DIGEST).to_pylist(),
            strict=True,
        )
    ):
        ids = None if not tokens[i].is_valid else tokens[i].values.to_numpy()
        version = [(s["start"], s["version"]) for s in spans] or None
        a, b = int(offsets[i]), int(offsets[i + 1])
        request = PutRequest(sid, routes[a:b], prompt, ids, version)
        yield sid, request, digest
