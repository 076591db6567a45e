"""Routes that outlive the store: save refs' samples to an Arrow IPC file, load them back.
(One module over 400 lines by design: one file format, its writer and its checking reader
side by side.)

A route archive (version 2) is one Arrow IPC *file* (footer and all: a truncated file does
not open): the routes schema (`routing_replay.schema`) plus each sample's policy-version
spans, token digest and put serial. The schema's metadata (layout, version, sample and
batch counts) carries a CRC-32 of itself; every record batch carries a CRC-32 of its index
and everything it holds (lengths, null counts, validity, offsets, values) in its custom
metadata. `save_routes` streams: it reads `chunk_tokens` tokens at a time (reading the next
chunk while a thread checksums and writes the last, unless `read` returns memory of the
batch being written, as a read into one reused `out=` buffer does: then the file is written
again, each chunk read once the last is written), so saving 10 GB needs two chunks of
memory; it writes to a temporary name of its own, fsyncs, renames and fsyncs the directory,
so a crash never leaves a partial archive under the name (and of saves to one path at once,
the last to finish is the file, whole). `load_routes` checks the schema (its
metadata's CRC before parsing the layout, then the whole schema), the layout, every batch
(fully validated by Arrow and checked against its CRC before any column is decoded), the
refs asked for, and the token ids against their digests, then puts the samples with one
`put_many` (the routes are views of the batches read into memory, never of a mapping of
the file, which could change between the check and the copy): a damaged file raises
`CorruptArchiveError` and never reaches the store, and a load is all or nothing, even if
the loading process dies in the middle. Old refs map to new ones by sample id, checked
against the saved serial and token digest (a ref of another put of that id is refused).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import numbers
import os
import re
import secrets
import stat
import struct
import time
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
    RoutingReplayError,
    SampleNotFoundError,
    SampleReplacedError,
    StoreUnavailableError,
)
from routing_replay.reader import stored_ids
from routing_replay.schema import (
    NUM_TOKENS,
    PROMPT_LEN,
    ROUTED_EXPERTS,
    SAMPLE_ID,
    TOKEN_IDS,
    int32_values,
    layout_of,
    routes_schema,
)
from routing_replay.store.files import open_file
from routing_replay.store.format import NO_DIGEST
from routing_replay.store.refs import PutRequest, RoutingRef
from routing_replay.store.samples import token_digest

if TYPE_CHECKING:
    from routing_replay.layout import RoutingLayout
    from routing_replay.store.routing_store import RoutingStore

ARCHIVE_KEY = b"routing_replay.archive"  # schema metadata: the archive format's version
ARCHIVE_VERSION = b"2"  # 2: sample and batch counts, CRCs of the metadata and all of a batch
SAMPLES_KEY = b"routing_replay.archive.samples"  # schema metadata: samples in the file
BATCHES_KEY = b"routing_replay.archive.batches"  # schema metadata: record batches in it
METADATA_CRC_KEY = b"routing_replay.archive.crc32"  # CRC-32 of the other metadata entries
CRC_KEY = b"crc32"  # record batch metadata: `batch_crc` of the batch
POLICY_VERSIONS, TOKENS_DIGEST, SERIAL = "policy_versions", "tokens_digest", "serial"
DEFAULT_CHUNK_TOKENS = 1 << 18  # tokens read and written at a time (~100 MB of Qwen3 routes)
DEAD_PARTIAL_S = 60.0  # a killed save's temporary file, unlocked and unwritten this long, goes
_PARTIAL = re.compile(r"\.partial-\d+-[0-9a-f]{12}")  # what `_temp_file` names: no other file
SPANS = pa.list_(pa.struct([("start", pa.int64()), ("version", pa.int64())]))


def archive_schema(layout: RoutingLayout, samples: int, batches: int) -> pa.Schema:
    """The routes schema plus each sample's spans, digest and serial; its metadata (layout,
    version, sample and batch counts) carries a CRC-32 of itself."""
    base = routes_schema(layout)
    extra = [
        pa.field(POLICY_VERSIONS, SPANS, nullable=False),
        pa.field(TOKENS_DIGEST, pa.uint64(), nullable=False),
        pa.field(SERIAL, pa.uint64(), nullable=False),
    ]
    meta = {
        **base.metadata,
        ARCHIVE_KEY: ARCHIVE_VERSION,
        SAMPLES_KEY: str(samples).encode(),
        BATCHES_KEY: str(batches).encode(),
    }
    return pa.schema([*base, *extra], metadata={**meta, METADATA_CRC_KEY: metadata_crc(meta)})


def metadata_crc(meta: dict[bytes, bytes]) -> bytes:
    """CRC-32 of the metadata entries (but its own), each key and value length-prefixed."""
    crc = 0
    for key, value in sorted(meta.items()):
        if key != METADATA_CRC_KEY:
            crc = zlib.crc32(struct.pack("<II", len(key), len(value)) + key + value, crc)
    return str(crc).encode()


def batch_crc(batch: pa.RecordBatch, index: int) -> int:
    """CRC-32 of the batch's index in the file and of all it holds as Arrow's IPC writer
    lays it out: each array's length and null count, validity bits, offsets (rebased to 0)
    and values, children after their parent. It is the same however the arrays are sliced
    or padded in memory, so the batch written and the batch read back agree."""
    crc = zlib.crc32(struct.pack("<qq", index, batch.num_rows))
    for column in batch.columns:
        crc = _array_crc(column, crc)
    return crc


def _array_crc(array: pa.Array, crc: int) -> int:
    """`crc` continued over the array (the types an archive holds)."""
    kind, n, at = array.type, len(array), array.offset
    buffers = array.buffers()
    crc = zlib.crc32(struct.pack("<qq", n, array.null_count), crc)
    if array.null_count:
        bits = np.unpackbits(np.frombuffer(buffers[0], np.uint8), bitorder="little")
        crc = zlib.crc32(np.packbits(bits[at : at + n], bitorder="little"), crc)
    if pa.types.is_struct(kind):
        for i in range(kind.num_fields):
            crc = _array_crc(array.field(i), crc)
    elif pa.types.is_fixed_size_list(kind):
        size = kind.list_size
        crc = _array_crc(array.values.slice(at * size, n * size), crc)
    elif pa.types.is_list(kind) or pa.types.is_string(kind):
        offsets = np.frombuffer(buffers[1], np.int32, count=n + 1, offset=at * 4)
        first, last = int(offsets[0]), int(offsets[-1])
        crc = zlib.crc32(offsets - offsets[0], crc)
        if pa.types.is_string(kind):
            crc = zlib.crc32(_span(buffers[2], first, last), crc)
        else:
            crc = _array_crc(array.values.slice(first, last - first), crc)
    else:  # fixed-width integers
        width = kind.bit_width // 8
        crc = zlib.crc32(_span(buffers[1], at * width, (at + n) * width), crc)
    return crc


def _span(buf: pa.Buffer | None, start: int, stop: int) -> memoryview | bytes:
    return b"" if buf is None or stop <= start else memoryview(buf)[start:stop]


def _file_path(path: Any, what: str) -> str:
    """`path` as a str, or InvalidArgumentError."""
    try:
        return os.fsdecode(path)
    except TypeError:
        raise InvalidArgumentError(
            f"{what}: path must be a str or os.PathLike naming the archive file, got "
            f"{type(path).__name__} {path!r}"
        ) from None


def save_routes(
    path: str | os.PathLike,
    refs: Sequence[RoutingRef],
    *,
    read: Callable[[list[RoutingRef]], pa.RecordBatch],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> int:
    """Save the refs' samples to the archive `path`; returns the bytes written.

    `read(refs)` returns their Arrow batch (`store.read` in one process,
    `routing_replay.ray.fetch_batch` on Ray; memory they reuse, `out=`, is fine). Samples
    are read and written `chunk_tokens` tokens at a time; the file appears under `path`
    only once complete (fsynced, and its directory after the rename). Each save writes its
    own temporary file: of saves to one path at once, the last to finish is the file. A
    path that is a directory, or in one that does not exist, is an `InvalidArgumentError`;
    a disk that fails or fills up a `StoreUnavailableError` (an `OSError`): either leaves
    nothing behind.
    """
    refs = list(refs)
    if not refs or not all(isinstance(r, RoutingRef) for r in refs):
        raise InvalidArgumentError("save_routes needs a non-empty list of RoutingRefs")
    if len({r.sample_id for r in refs}) != len(refs):
        raise InvalidArgumentError("save_routes names a sample more than once")
    if (
        isinstance(chunk_tokens, bool)
        or not isinstance(chunk_tokens, numbers.Integral)
        or chunk_tokens < 1
    ):
        raise InvalidArgumentError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    chunk_tokens = int(chunk_tokens)
    if not callable(read):
        raise InvalidArgumentError(
            f"save_routes: read must be the function that reads refs into their Arrow batch "
            f"(store.read, or routing_replay.ray.fetch_batch), got {read!r}"
        )
    path = _file_path(path, "save_routes")
    if os.path.isdir(path):
        raise InvalidArgumentError(
            f"save_routes: {path} is a directory: name the archive file in it, e.g. "
            f"{os.path.join(path, 'routes.arrow')}"
        )
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise InvalidArgumentError(
            f"save_routes: {path} exists and is not a regular file (a device, a pipe, a "
            "symbolic link): the archive would replace it; name a file path"
        )
    chunks = list(_chunks(refs, chunk_tokens))
    _remove_dead_partials(path)
    made: list[str] = []  # the temporary file, named before it is made: removed on any error
    try:
        _write_file(_temp_file(path, made), path, refs, chunks, read)
        with _disk(path, "renaming the finished file to"):
            os.replace(made[0], path)
    except BaseException:
        for tmp in made:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    with _disk(path, "syncing the directory of", saved=True):
        _fsync_dir(os.path.dirname(path) or ".")  # the rename itself survives a power cut
        return os.path.getsize(path)


def _write_file(f: Any, path: str, refs: list[RoutingRef], chunks: list, read: Any) -> None:
    """Write the archive into the open file `f`, sync it, close it (whatever happens)."""
    try:
        # Reading the next chunk while the last is written is safe only if `read` returns
        # new memory: when it returns memory of the batch still being written (`out=`), the
        # file may hold its next batch's routes, so it is written again, each batch written
        # before the next is read.
        if not _write_batches(f, path, refs, chunks, read, overlap=True):
            with _disk(path, "rewriting"):
                f.seek(0)
                f.truncate()
            _write_batches(f, path, refs, chunks, read, overlap=False)
        with _disk(path, "syncing"):
            f.flush()
            os.fsync(f.fileno())
    finally:
        with contextlib.suppress(OSError):  # after an error, flushing may fail again
            f.close()


def _temp_file(path: str, made: list[str]) -> Any:
    """A new file, `path` plus `.partial-<pid>-<random>`, for this save alone (other saves
    to `path`, of other threads or of other containers' pid 1, write their own). Its name is
    in `made` before it exists, so a stop at any line leaves nothing the caller cannot remove."""
    for _ in range(16):
        tmp = f"{path}.partial-{os.getpid()}-{secrets.token_hex(6)}"
        made[:] = [tmp]
        try:
            # Owned by the file object from this line: a stop anywhere leaks no descriptor.
            raw = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            made.clear()  # another save's file (a 48-bit name collision): never ours to remove
            continue
        except (FileNotFoundError, NotADirectoryError) as e:
            made.clear()
            raise InvalidArgumentError(
                f"save_routes: cannot create {path} ({e.strerror}): its directory "
                f"{os.path.dirname(path) or '.'} does not exist; create it first"
            ) from e
        except OSError as e:
            made.clear()
            raise StoreUnavailableError(
                f"save_routes: cannot create a file next to {path} ({e}): check the path "
                "and that this process may write in its directory; nothing was saved"
            ) from e
        try:
            fcntl.flock(raw.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while the save lives
            return io.BufferedWriter(raw)
        except BaseException:
            raw.close()
            raise
    raise StoreUnavailableError(f"save_routes: no free temporary name next to {path}")


def _remove_dead_partials(path: str) -> None:
    """Remove the temporary files that saves to `path` killed mid-write (SIGKILL, a node
    lost) left: ours (this user's), unwritten for `DEAD_PARTIAL_S`, and locked by no one (a
    live save holds its file's flock). Anything in doubt stays."""
    folder, base = os.path.split(path)
    try:
        names = [
            n
            for n in os.listdir(folder or ".")
            if n.startswith(base) and _PARTIAL.fullmatch(n[len(base) :])
        ]
    except OSError:
        return
    for name in names:
        full = os.path.join(folder, name)
        with contextlib.suppress(OSError), open_file(full, os.O_RDONLY) as file:
            st = os.fstat(file.fileno())
            old = time.time() - st.st_mtime > DEAD_PARTIAL_S
            if old and st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode):
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # blocks: alive
                os.unlink(full)


@contextlib.contextmanager
def _disk(path: str, what: str, saved: bool = False) -> Iterator[None]:
    """Writing the archive `path`: an OSError (a full disk, a file size limit, a failing
    device) is a StoreUnavailableError that says so."""
    try:
        yield
    except OSError as e:
        if isinstance(e, RoutingReplayError):
            raise
        done = (
            "the archive is complete under that name, but the rename may not survive a power cut"
            if saved
            else "nothing was saved there"
        )
        raise StoreUnavailableError(
            f"save_routes: {what} {path} failed ({type(e).__name__}: {e}): {done}; free "
            "space on that disk (or raise its limits) and save again"
        ) from e


def _write_batches(
    f: Any,
    path: str,
    refs: list[RoutingRef],
    chunks: list[list[RoutingRef]],
    read: Callable[[list[RoutingRef]], pa.RecordBatch],
    *,
    overlap: bool,
) -> bool:
    """Write the chunks' batches to `f`: with `overlap`, read each while a thread checksums
    and writes the one before (zlib and Arrow's file writes release the GIL). False if a
    read returned memory of the batch being written (it may have changed under the write:
    what `f` holds is not the archive), once that write is done; else True."""
    with ThreadPoolExecutor(1, "save_routes") as pool:
        # `last`: the batch being written, kept alive until the next one is compared with
        # it (memory it freed may be new memory of the next: that is no reuse).
        writer, pending, schema, last = None, None, None, None
        for i, chunk in enumerate(chunks):
            if pending is not None and not overlap:
                with _disk(path, "writing"):
                    pending.result()
            batch = read(chunk)
            if schema is None:
                schema = archive_schema(layout_of(batch), len(refs), len(chunks))
            batch = _archive_batch(batch, chunk, schema)
            if pending is not None:
                with _disk(path, "writing"):
                    pending.result()
                if overlap and _overlaps(_memory(batch), _memory(last)):
                    with _disk(path, "writing"):
                        writer.close()
                    return False
            with _disk(path, "writing"):
                writer = writer or ipc.new_file(f, schema)
            pending, last = pool.submit(_write, writer, batch, i), batch
        with _disk(path, "writing"):
            pending.result()
            writer.close()
    return True


def _memory(batch: pa.RecordBatch) -> list[tuple[int, int]]:
    """The memory the batch's buffers (children's too) span, as `(start, stop)` addresses."""
    spans = []
    for column in batch.columns:
        for buf in column.buffers():
            if buf is not None and buf.size:
                spans.append((buf.address, buf.address + buf.size))
    return spans


def _overlaps(a: list[tuple[int, int]], b: Sequence[tuple[int, int]]) -> bool:
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(writer: Any, batch: pa.RecordBatch, index: int) -> None:
    """Append `batch`, the `index`-th, with its CRC."""
    writer.write_batch(batch, custom_metadata={CRC_KEY: str(batch_crc(batch, index))})


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


def _archive_batch(
    batch: pa.RecordBatch, refs: list[RoutingRef], schema: pa.Schema
) -> pa.RecordBatch:
    """A read's batch with the refs' spans, digests and serials added (checked to match)."""
    if layout_of(batch) != layout_of(schema):
        raise LayoutMismatchError("read(refs) returned routes of two layouts: save them apart")
    if batch.column(SAMPLE_ID).to_pylist() != [r.sample_id for r in refs]:
        raise InvalidArgumentError("read(refs) must return the refs' samples, in order")
    counts = batch.column(NUM_TOKENS).to_pylist()
    if counts != [r.num_tokens for r in refs]:
        raise InvalidArgumentError(f"read(refs) returned {counts} tokens, the refs hold others")
    spans = [[{"start": s, "version": v} for s, v in r.policy_versions] for r in refs]
    columns = [
        *batch.columns,
        pa.array(spans, type=SPANS),
        pa.array(_saved_digests(batch, refs), type=pa.uint64()),
        pa.array([r.serial for r in refs], type=pa.uint64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _saved_digests(batch: pa.RecordBatch, refs: list[RoutingRef]) -> list[int]:
    """The digest of the token ids each row saves: its ref's, or, for a ref made by hand
    (no digest), that of the tokens read, which the load checks them against."""
    tokens = batch.column(TOKEN_IDS)
    digests = []
    for i, ref in enumerate(refs):
        digest = ref.tokens_digest
        if digest == NO_DIGEST and tokens[i].is_valid:
            digest = token_digest(tokens[i].values.to_numpy(zero_copy_only=False))
        digests.append(digest)
    return digests


@contextlib.contextmanager
def _parsing(path: str, what: str) -> Iterator[None]:
    """Reading the archive at `path`: an error that is not routing_replay's own (nor out of
    memory) means a file we cannot parse, a CorruptArchiveError."""
    try:
        yield
    except (RoutingReplayError, MemoryError):
        raise
    except Exception as e:
        raise CorruptArchiveError(
            f"{what} of {path} does not parse ({type(e).__name__}: {e}): the file is damaged "
            "or not written by save_routes; nothing was loaded"
        ) from e


class RouteArchive:
    """An archive opened for reading: its layout, samples and batches, each batch read into
    this process's memory (a file changed or cut under a mapping would reach the store
    unchecked, or kill the process with SIGBUS).

    Opening checks the schema: its metadata against its CRC before anything in it is
    parsed, then all of it against `archive_schema`. Each batch is checked against its CRC
    and fully validated by Arrow before any of its columns is decoded."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = _file_path(path, "load_routes")
        if os.path.isdir(self.path):
            raise InvalidArgumentError(f"load_routes: {self.path} is a directory, not an archive")
        try:
            # Opened without waiting (a FIFO would block), checked a regular file, then read
            # through that very open file (its /proc link: no race with a swap of the path).
            with open_file(self.path, os.O_RDONLY, follow=True) as checked:
                if not stat.S_ISREG(os.fstat(checked.fileno()).st_mode):
                    raise InvalidArgumentError(
                        f"load_routes: {self.path} is not a regular file (a FIFO, socket or "
                        "device): pass the path of an archive save_routes wrote"
                    )
                file = pa.OSFile(f"/proc/self/fd/{checked.fileno()}")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise InvalidArgumentError(
                f"load_routes: there is no archive file at {self.path} ({e.strerror or e})"
            ) from None
        except OSError as e:  # out of descriptors, no permission, a failing disk: not the file
            raise StoreUnavailableError(
                f"load_routes: {self.path} cannot be opened ({type(e).__name__}: {e}); nothing "
                "was loaded. Fix the cause (raise `ulimit -n`, the file's permissions, the "
                "disk) and load again"
            ) from e
        try:
            self._reader = ipc.open_file(file)
        except (pa.ArrowException, OSError) as e:
            raise CorruptArchiveError(
                f"{self.path} is not a complete route archive ({e}): truncated, damaged or not "
                "written by save_routes; save the routes again from their store"
            ) from None
        with _parsing(self.path, "the schema"):
            schema = self._reader.schema
            meta = dict(schema.metadata or {})
            self._check_metadata(meta)
            self.layout = layout_of(schema)
            self.num_samples = int(meta[SAMPLES_KEY])
            self._num_batches = int(meta[BATCHES_KEY])
            want = archive_schema(self.layout, self.num_samples, self._num_batches)
            if not schema.equals(want, check_metadata=True):
                raise CorruptArchiveError(
                    f"the schema of {self.path} is not the one save_routes writes for its "
                    f"layout: the file is damaged; nothing was loaded"
                )
            if self._reader.num_record_batches != self._num_batches:
                raise CorruptArchiveError(
                    f"{self.path} lists {self._reader.num_record_batches} record batches, its "
                    f"schema says {self._num_batches}: the file is damaged; nothing was loaded"
                )
        self._batches: list[pa.RecordBatch] | None = None

    def _check_metadata(self, meta: dict[bytes, bytes]) -> None:
        """The metadata's CRC (where there is one), then that it names this version."""
        version = ARCHIVE_VERSION.decode()
        if METADATA_CRC_KEY in meta and meta[METADATA_CRC_KEY] != metadata_crc(meta):
            raise CorruptArchiveError(
                f"the schema metadata of {self.path} fails its CRC check: the file was damaged "
                "after it was written; nothing was loaded"
            )
        if ARCHIVE_KEY not in meta:
            raise CorruptArchiveError(
                f"{self.path} is an Arrow file but not a route archive of version {version}: "
                "write it with routing_replay.save_routes"
            )
        if meta[ARCHIVE_KEY] != ARCHIVE_VERSION:
            raise CorruptArchiveError(
                f"{self.path} is not a route archive of version {version} (it says version "
                f"{meta[ARCHIVE_KEY].decode(errors='replace')!r}): load it with the "
                "routing_replay that saved it"
            )
        if METADATA_CRC_KEY not in meta:
            raise CorruptArchiveError(
                f"the schema metadata of {self.path} has no CRC: the file is damaged; nothing "
                "was loaded"
            )

    def batches(self) -> list[pa.RecordBatch]:
        """Every record batch, each checked (once) against its CRC, fully validated, and its
        rows against each other: only then are its columns decoded."""
        if self._batches is None:
            with _parsing(self.path, "a record batch"):
                batches = [self._verified(i) for i in range(self._num_batches)]
                ids = [sid for b in batches for sid in b.column(SAMPLE_ID).to_pylist()]
            if len(ids) != self.num_samples or len(set(ids)) != len(ids):
                raise CorruptArchiveError(
                    f"{self.path} holds {len(ids)} samples ({len(set(ids))} ids), its schema "
                    f"says {self.num_samples}: the file is damaged; nothing was loaded"
                )
            self._batches = batches
        return self._batches

    def _verified(self, i: int) -> pa.RecordBatch:
        """Batch `i`, fully validated by Arrow (offsets, UTF-8, null counts: safe to read
        through), then checked against its CRC and its rows against each other."""
        try:
            batch, meta = self._reader.get_batch_with_custom_metadata(i)
            batch.validate(full=True)
            want = int((meta or {}).get(CRC_KEY, b"-1"))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptArchiveError(
                f"record batch {i} of {self.path} does not read ({e}): the file was damaged "
                "after it was written; nothing was loaded"
            ) from None
        if want != batch_crc(batch, i):
            raise CorruptArchiveError(
                f"record batch {i} of {self.path} fails its CRC check: the file was "
                "damaged after it was written; nothing was loaded"
            )
        counts = int32_values(batch.column(NUM_TOKENS))
        tokens = batch.column(TOKEN_IDS)
        routed = np.diff(_offsets(batch.column(ROUTED_EXPERTS)))
        has = _valid(tokens)
        if not (
            np.array_equal(routed, counts)
            and np.array_equal(np.diff(_offsets(tokens))[has], counts[has])
        ):
            raise CorruptArchiveError(
                f"record batch {i} of {self.path}: its routes or token ids disagree with its "
                "token counts; nothing was loaded"
            )
        return batch

    def check(self, layout: RoutingLayout, refs: Sequence[RoutingRef] | None) -> None:
        """The layout, then (unless `refs` is empty) every batch (`batches`) and the refs
        asked for against the samples' ids, serials and digests. Raises before anything is
        loaded."""
        if layout != self.layout:
            raise LayoutMismatchError(
                f"{self.path} holds routes of {self.layout}, the store is for {layout}: load "
                "it into a store of the archive's layout"
            )
        if refs is not None and not refs:
            return
        saved: dict[str, tuple[int, int, int]] = {}
        with _parsing(self.path, "the sample ids"):
            for batch in self.batches():
                for sid, n, digest, serial in zip(
                    batch.column(SAMPLE_ID).to_pylist(),
                    batch.column(NUM_TOKENS).to_pylist(),
                    batch.column(TOKENS_DIGEST).to_pylist(),
                    batch.column(SERIAL).to_pylist(),
                    strict=True,
                ):
                    saved[sid] = (n, digest, serial)
        for ref in refs or ():
            if ref.sample_id not in saved:
                raise SampleNotFoundError(
                    f"sample {ref.sample_id!r} is not in {self.path}: it was not saved "
                    "there; nothing was loaded"
                )
            n, digest, serial = saved[ref.sample_id]
            by_hand = ref.serial == 0 and ref.tokens_digest == NO_DIGEST  # names no one put
            if ref.num_tokens != n or (
                not by_hand and (ref.tokens_digest, ref.serial) != (digest, serial)
            ):
                raise SampleReplacedError(
                    f"ref {ref.sample_id!r} names another put of that id than the one saved "
                    f"in {self.path}; nothing was loaded"
                )

    def requests(self, wanted: set[str] | None = None) -> list[PutRequest]:
        """The samples (those of `wanted`) as put requests, in file order, after their token
        ids were checked against the digests saved with them. The routes are views of the
        checked batches."""
        requests = []
        with _parsing(self.path, "a sample"):
            for batch in self.batches():
                for request, digest in _requests(batch, self.layout):
                    if wanted is not None and request.sample_id not in wanted:
                        continue
                    ids = request.token_ids
                    if digest != (NO_DIGEST if ids is None else token_digest(ids)):
                        raise CorruptArchiveError(
                            f"sample {request.sample_id!r} of {self.path}: its token ids do "
                            "not match the digest saved with them; nothing was loaded"
                        )
                    requests.append(request)
        return requests


def _offsets(array: pa.ListArray) -> np.ndarray:
    """A (validated) list array's offsets, as numpy."""
    return np.frombuffer(
        array.buffers()[1], np.int32, count=len(array) + 1, offset=array.offset * 4
    )


def _valid(array: pa.Array) -> np.ndarray:
    """Which rows of a (validated) array are not null, as numpy bools."""
    if not array.null_count:
        return np.ones(len(array), dtype=bool)
    bits = np.unpackbits(np.frombuffer(array.buffers()[0], np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)].astype(bool)


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
    if refs is not None:
        refs = list(refs)
        if not all(isinstance(r, RoutingRef) for r in refs):
            raise InvalidArgumentError("load_routes takes a list of RoutingRefs (or None: all)")
        if len({r.sample_id for r in refs}) != len(refs):
            raise InvalidArgumentError("load_routes names a sample more than once; nothing loaded")
    archive = RouteArchive(path)
    archive.check(store.layout, refs)
    if refs is not None and not refs:
        return []
    # Every batch is checked, and every sample's token ids, before one put_many: a damaged
    # file never reaches the store, and the whole load is one commit in it, so not even a
    # crash of this process half-loads it. The routes are views of the checked batches.
    requests = archive.requests(None if refs is None else {r.sample_id for r in refs})
    loaded = store.put_many(requests, timeout=timeout)
    if refs is None:
        return loaded
    by_id = {r.sample_id: r for r in loaded}
    return [by_id[r.sample_id] for r in refs]


def _requests(batch: pa.RecordBatch, layout: RoutingLayout) -> Iterator[tuple[PutRequest, int]]:
    """(PutRequest, saved digest) of each row of a verified batch."""
    L, K = layout.num_moe_layers, layout.top_k
    routes = stored_ids(batch, layout).reshape(-1, L, K)  # narrow, as put stores them
    offsets = np.concatenate([[0], np.cumsum(int32_values(batch.column(NUM_TOKENS)))])
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
        yield PutRequest(sid, routes[a:b], prompt, ids, version), digest
