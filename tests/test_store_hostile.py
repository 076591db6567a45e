"""Hostile and corrupted segments, on real processes and real /dev/shm: the store trusts
nothing it did not make.

- squatting: another user (a real second uid) takes a store's name first, with a store of
  its own, a symbolic link, a socket or a FIFO;
- loose modes: a file of this user's that others could have written;
- hostile headers: a file of this user's, mode 0600, whose header no store wrote;
- corruption fuzz: a real store's header and tables with random bytes changed; every
  operation runs on it in a child process and must succeed or raise a RoutingReplayError,
  never hang, crash, raise anything else, or read back routes other than the ones put.

`ROUTING_REPLAY_SOAK=1` runs 10x the fuzz trials.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import socket
import subprocess
import time
import traceback
import warnings

import numpy as np
import pytest
from lean_workers import in_lean_workers

from routing_replay import Episode, RoutingLayout, RoutingStore
from routing_replay import cli as cli_module
from routing_replay.errors import CorruptStoreError, RoutingReplayError, StoreUnavailableError
from routing_replay.store import list_stores, sweep_stores
from routing_replay.store.format import (
    HEADER_DTYPE,
    LEASE_DTYPE,
    PAGE_DTYPE,
    SLOT_DTYPE,
    regions,
)
from routing_replay.store.segment import SHM_DIR, segment_path

SOAK = 10 if os.environ.get("ROUTING_REPLAY_SOAK") else 1
LAYOUT = RoutingLayout(4, 2, 8)
FORK = mp.get_context("fork")
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become a second user")


def routes(seed: int, num_tokens: int) -> np.ndarray:
    return LAYOUT.random_routes(np.random.default_rng(seed), num_tokens)


def write_segment(path: str, data: bytes, mode: int = 0o600) -> None:
    """A segment file of this user's with `data`, made the way no store makes one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


def remove(*paths: str) -> None:
    for path in paths:
        if os.path.lexists(path):
            os.unlink(path)


def cli(*args: str) -> subprocess.CompletedProcess:
    """`routing-replay ARGS`, run in this process (the CLI's `main`; no venv `bin` needed)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_module.main(list(args))
    return subprocess.CompletedProcess(
        ["routing-replay", *args], code, out.getvalue(), err.getvalue()
    )


def swept(prefix: str) -> tuple[list[str], list[str]]:
    """(names sweep_stores removed, its warnings) for the stores named `prefix`..."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        removed = [info.name for info in sweep_stores(prefix=prefix)]
    return removed, [str(w.message) for w in caught]


# -- another user took the name first --------------------------------------------------------


def as_nobody(plant, *args) -> None:
    """Run `plant(*args)` in a forked child that became uid and gid 65534 (nobody)."""

    def run() -> None:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        plant(*args)

    p = FORK.Process(target=run)
    p.start()
    p.join(60)
    assert p.exitcode == 0


def plant_store(name: str, mode: int) -> None:
    """A real store of nobody's, holding poisoned routes, left behind with `mode`."""
    store = RoutingStore.create(name, LAYOUT, capacity_tokens=64, page_tokens=4)
    store.put("victim-sample", np.full((8, 4, 2), 3) + np.arange(2))
    store.close()  # exits without unlinking: the file stays, its owner lease goes
    os.chmod(segment_path(name), mode)


def plant_symlink(name: str, target: str) -> None:
    os.symlink(target, segment_path(name))


def plant_socket(name: str) -> None:
    socket.socket(socket.AF_UNIX).bind(segment_path(name))


def plant_fifo(name: str) -> None:
    os.mkfifo(segment_path(name), 0o666)
    os.chmod(segment_path(name), 0o666)


NOT_YOURS = "belongs to nobody (uid 65534), not to you (root (uid 0))"
SQUATS = {  # kind -> why the file is not used
    "store-0666": NOT_YOURS,
    "store-0600": NOT_YOURS,
    "symlink": "is a symbolic link of nobody (uid 65534), not a regular file",
    "socket": "is a socket of nobody (uid 65534), not a regular file",
    "fifo": "is a FIFO of nobody (uid 65534), not a regular file",
}


def squat(name: str, kind: str, link_target: str) -> os.stat_result:
    """Have nobody take `name` first with a file of `kind`; its lstat."""
    if kind.startswith("store"):
        as_nobody(plant_store, name, int(kind[-4:], 8))
        with open(segment_path(name), "rb") as f:
            assert f.read(8) == b"RRSTORE1"  # a real store, with poisoned routes
    elif kind == "symlink":
        as_nobody(plant_symlink, name, link_target)
    else:
        as_nobody({"socket": plant_socket, "fifo": plant_fifo}[kind], name)
    st = os.stat(segment_path(name), follow_symlinks=False)
    assert st.st_uid == NOBODY
    return st


def refusal(path: str, reason: str) -> str:
    """What attach says of a file it does not use."""
    return (
        f"{path} {reason}: a store is attached only if it is yours with mode 0600, so this "
        "file is not used. If another user's job has this name, pick another store name "
        f"(include your job); if it is a leftover, its owner (or root) removes it: rm {path}"
    )


@as_root
@pytest.mark.parametrize("kind", list(SQUATS))
def test_name_squatted_by_another_user_is_never_used(name, kind):
    path, reason = segment_path(name), SQUATS[kind]
    mine = "mine-" + name  # the symbolic link points at a real store of root's
    good = routes(1, 10)
    try:
        with RoutingStore.create(mine, LAYOUT, capacity_tokens=64, page_tokens=4) as store:
            store.put("victim-sample", good)
            st = squat(name, kind, segment_path(mine))
            with pytest.raises(StoreUnavailableError) as e:
                RoutingStore.create(name, LAYOUT, capacity_tokens=64)
            assert str(e.value) == (
                f"store name {name!r} is taken: {path} {reason}. It is not used; pick another "
                f"store name (include your job), or have its owner (or root) remove it: rm {path}"
            )
            with pytest.raises(StoreUnavailableError) as e:
                RoutingStore.attach(name)  # never maps it: nothing of it is ever served
            assert str(e.value) == refusal(path, reason)
            [info] = list_stores(prefix=name)
            assert (info.name, info.owner_uid, info.problem) == (name, NOBODY, reason)
            assert (info.layout, info.stats, info.owner_alive) == (None, None, True)
            assert swept(name) == ([], [f"routing-replay sweep skipped {path}: {reason}"])
            assert os.stat(path, follow_symlinks=False) == st  # not removed, not touched
            # root's own store, behind the link, is untouched and still served
            assert np.array_equal(store.get("victim-sample"), good)
            store.verify()
    finally:
        remove(path)


# -- this user's file, but others may have written it ----------------------------------------


def closed_store(name: str, sample: np.ndarray) -> None:
    """A real store holding `sample` as "s", its owner gone (sweep would remove it)."""
    store = RoutingStore.create(name, LAYOUT, capacity_tokens=64, page_tokens=4)
    store.put("s", sample)
    store.close()


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o660, 0o700, 0o400])
def test_own_file_with_a_loose_mode_is_refused_and_never_swept(name, mode):
    path, good = segment_path(name), routes(2, 9)
    closed_store(name, good)
    os.chmod(path, mode)
    reason = f"has mode {mode:04o}, not 0600"
    with pytest.raises(StoreUnavailableError) as e:
        RoutingStore.attach(name)
    assert str(e.value) == refusal(path, reason)
    [info] = list_stores(prefix=name)
    assert (info.problem, info.stats, info.layout) == (reason, None, None)
    assert swept(name) == ([], [f"routing-replay sweep skipped {path}: {reason}"])
    assert os.path.exists(path)
    os.chmod(path, 0o600)  # the same bytes, with a store's mode: used, then swept
    with RoutingStore.attach(name) as attached:
        assert np.array_equal(attached.get("s"), good)
    assert swept(name) == ([name], [])
    assert not os.path.exists(path)


# -- this user's file, mode 0600, but its header was not written by a store ---------------


def a_store_image(name: str) -> bytes:
    """The bytes of a real closed store (one sample), the segment removed."""
    closed_store(name, routes(3, 7))
    with open(segment_path(name), "rb") as f:
        data = f.read()
    os.unlink(segment_path(name))
    return data


def with_field(data: bytes, field: str, value: bytes) -> bytes:
    dtype, offset = HEADER_DTYPE.fields[field][:2]
    assert len(value) <= dtype.itemsize
    return data[:offset] + value.ljust(dtype.itemsize, b"\0") + data[offset + dtype.itemsize :]


LAYOUT_JSON = '{{"num_layers":4,"top_k":2,"num_experts":8,"moe_layers":{}}}'
HOSTILE_HEADERS = {  # what no store writes, and what parsing it raised before it was caught
    "deep": ("layout", b"[" * 2000, "RecursionError"),
    "infinity": ("layout", LAYOUT_JSON.format("[0,1,2,Infinity]").encode(), "OverflowError"),
    "nan": ("layout", LAYOUT_JSON.format("[0,1,2,NaN]").encode(), "ValueError"),
    "huge": ("layout", LAYOUT_JSON.format("[0,1,2,3e400]").encode(), "OverflowError"),
    "dict": ("layout", LAYOUT_JSON.format("[0,1,2,{}]").encode(), "TypeError"),
    "str": ("layout", LAYOUT_JSON.format('"0123"').replace("4", "1e999").encode(), "ValueError"),
    "bytes": ("layout", b"\xff\xfe not json", "UnicodeDecodeError"),
    "empty": ("layout", b"", "JSONDecodeError"),
    "node_id": ("node_id", b"\xff\xfe\xfd", "UnicodeDecodeError"),
}


@pytest.mark.parametrize("case", list(HOSTILE_HEADERS))
def test_hostile_header_of_own_file_is_corrupt_and_swept(name, case):
    field, value, _ = HOSTILE_HEADERS[case]
    path = segment_path(name)
    write_segment(path, with_field(a_store_image(name), field, value))
    with pytest.raises(CorruptStoreError) as e:
        RoutingStore.attach(name)
    assert str(e.value).startswith(
        f"store {name!r} is corrupt (header layout or node id unreadable: "
    )
    assert str(e.value).endswith("or by `routing-replay sweep` once its owner has exited")
    [info] = list_stores(prefix=name)
    assert (info.stats, info.problem, info.corrupt) == (None, str(e.value), True)
    # Its owner is gone and it is ours: sweep removes it, as the error says.
    assert swept(name) == ([name], [])
    assert not os.path.exists(path)


def test_own_files_not_named_like_a_store_are_skipped(name):
    """`rr_` files whose name no store can have: never opened, never removed, said so."""
    problem = "its name is not a store name: it is not opened"
    image = a_store_image(name)  # a whole store, its owner gone: swept if it were named well
    paths = [os.path.join(SHM_DIR, f"rr_{n}") for n in bad_names(name)]
    try:
        for path in paths:
            write_segment(path, image)
        for prefix in (name, "." + name):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert sweep_stores(prefix=prefix) == []
            skipped = sorted(p for p in paths if os.path.basename(p).startswith(f"rr_{prefix}"))
            assert [str(w.message) for w in caught] == [
                f"routing-replay sweep skipped {p}: {problem}" for p in skipped
            ]
            assert [(i.path, i.problem, i.layout) for i in list_stores(prefix)] == [
                (p, problem, None) for p in skipped
            ]
        assert all(os.path.exists(p) for p in paths)
        with pytest.raises(ValueError, match="is invalid"):
            RoutingStore.attach(f"{name}\n")  # and no handle opens one
    finally:
        remove(*paths)


def bad_names(name: str) -> list[str]:
    return [f"{name} x", f"{name}\u00e9", f"{name}\n", f"{name}\x1b[2J", f".{name}"]


def shown(path: str) -> str:
    """A path as the CLI prints it: a terminal never sees a name's control characters."""
    return path if path.isprintable() else path.replace("\n", "\\n").replace("\x1b", "\\x1b")


def test_cli_says_what_it_skips_and_exits_0(name):
    """`routing-replay ls --verify` and `sweep --dry-run` over every kind of hostile file."""
    expected: dict[str, str] = {}  # path -> the reason it is skipped
    made = []
    try:
        if os.geteuid() == 0:
            for kind in SQUATS:
                n = f"{name}-{kind}"
                made.append(segment_path(n))
                squat(n, kind, segment_path(name + "-corrupt"))
                expected[segment_path(n)] = SQUATS[kind]
        for mode in (0o644, 0o666):
            n = f"{name}-{mode:o}"
            made.append(segment_path(n))
            closed_store(n, routes(4, 5))
            os.chmod(segment_path(n), mode)
            expected[segment_path(n)] = f"has mode {mode:04o}, not 0600"
        image = a_store_image(name)
        for n in bad_names(name)[:4]:
            made.append(os.path.join(SHM_DIR, f"rr_{n}"))
            write_segment(made[-1], image)
            expected[made[-1]] = "its name is not a store name: it is not opened"
        corrupt_one = segment_path(name + "-corrupt")  # ours: listed as corrupt, swept
        made.append(corrupt_one)
        write_segment(corrupt_one, with_field(image, "layout", b"not json"))

        out = cli("ls", "--verify")
        assert (out.returncode, out.stderr) == (0, "")
        assert "\x1b" not in out.stdout
        lines = out.stdout.splitlines()
        for path, reason in expected.items():  # a name's newline is shown as \\n
            assert f"  skipped {shown(path)}: {reason}" in lines, out.stdout
        [row] = [line for line in lines if line.startswith(f"{name}-corrupt ")]
        assert row.endswith("unreadable: Expecting value: line 1 column 1 (char 0)): its routes "
                            "cannot be trusted. Stop "
                            "its writers, create a new store, and re-run the rollouts it held; "
                            "the old segment is removed by its owner's store.unlink(), or by "
                            "`routing-replay sweep` once its owner has exited")  # fmt: skip
        out = cli("sweep", "--dry-run")
        assert (out.returncode, out.stderr) == (0, "")
        lines = out.stdout.splitlines()
        for path, reason in expected.items():
            assert f"skipped {shown(path)}: {reason}" in lines, out.stdout
            assert not any(line.startswith(f"would remove {path} ") for line in lines)
        assert f"would remove {corrupt_one} (its owner, pid {os.getpid()}, is dead)" in lines
    finally:
        remove(*made)


# -- corruption fuzz -----------------------------------------------------------------------

FUZZ_TRIALS = 500 * SOAK
CHILD_TIMEOUT_S = 15.0
PUT_TIMEOUT_S = 0.05
P = 4  # page tokens


def fuzz_samples() -> dict[str, tuple[np.ndarray, np.ndarray | None, int | None]]:
    """id -> (routes, token_ids, prompt_len): prompts shared by several samples."""
    out = {}
    for prompt in range(2):
        tokens = np.arange(12) + 100 * prompt
        head = routes(10 + prompt, 12)
        for k in range(3):
            n = 15 + 3 * k
            r = np.concatenate([head, routes(20 + 10 * prompt + k, n - 12)])
            t = np.concatenate([tokens, np.arange(n - 12) + 1000 * (k + 1)])
            out[f"p{prompt}-s{k}"] = (r, t, 12)
    # same tokens as p0, other routes: a second page under the same key (a twin chain)
    out["p0-twin"] = (routes(30, 13), np.concatenate([np.arange(12), [7]]), None)
    out["solo"] = (routes(31, 10), None, None)
    out["gone"] = (np.concatenate([routes(10, 12), routes(32, 6)]), np.arange(18), 12)
    return out


def new_sample() -> tuple[np.ndarray, np.ndarray]:
    r = np.concatenate([routes(10, 12), routes(40, 9)])  # shares p0's prompt pages
    return r, np.concatenate([np.arange(12), np.arange(9) + 5000])


def field_spans(raw: bytes) -> list[tuple[str, int, int]]:
    """(what, offset, size) of every field of every record of the header and tables."""
    hdr = np.frombuffer(raw[: HEADER_DTYPE.itemsize], HEADER_DTYPE)[0]
    sizes = {
        k: int(hdr[k])
        for k in (
            "page_tokens",
            "num_pages",
            "max_samples",
            "page_buckets",
            "sample_buckets",
            "max_writers",
        )
    }
    off = regions(LAYOUT.bytes_per_token, **sizes)
    spans = [(f"header.{f}", HEADER_DTYPE.fields[f][1], HEADER_DTYPE[f].itemsize)
             for f in HEADER_DTYPE.names]  # fmt: skip
    for region, dtype, count in (
        ("pages", PAGE_DTYPE, sizes["num_pages"]),
        ("slots", SLOT_DTYPE, sizes["max_samples"]),
        ("leases", LEASE_DTYPE, sizes["max_writers"]),
    ):
        for i in range(count):
            for f in dtype.names:
                at = off[region] + i * dtype.itemsize + dtype.fields[f][1]
                spans.append((f"{region}[{i}].{f}", at, dtype[f].itemsize))
    for region, count in (
        ("page_heads", sizes["page_buckets"]),
        ("free_pages", sizes["num_pages"]),
        ("sample_heads", sizes["sample_buckets"]),
        ("free_slots", sizes["max_samples"]),
    ):
        spans += [(f"{region}[{i}]", off[region] + 4 * i, 4) for i in range(count)]
    return spans


def test_a_flipped_bit_of_a_turns_put_mark_is_caught(name):
    # Round 61: the mark an Episode's put leaves in its slot was outside the checksum: a
    # flipped bit passed verify(), and the turn, stopped after its commit, was refused for
    # good (DuplicateSampleError) with its sample stranded. Each bit is caught now.
    tokens, r = np.arange(12), routes(5, 12)
    with RoutingStore.create(name, LAYOUT, 1024, page_tokens=4) as store:
        episode = Episode(store, "e")
        episode.add_turn(tokens[:8], r[:8])
        ref = episode.add_turn(tokens, r)
        with open(segment_path(name), "r+b") as f:
            raw = f.read()
            value = {w: raw[at : at + n] for w, at, n in field_spans(raw)}
            (at,) = [
                at
                for w, at, n in field_spans(raw)
                if w.endswith(".mark") and value[w.replace(".mark", ".serial")] != bytes(8)
                and value[w.replace(".mark", ".sample_id")].rstrip(b"\0") == b"e-t2"
            ]  # fmt: skip
            for bit in range(64):
                f.seek(at + bit // 8)
                f.write(bytes([raw[at + bit // 8] ^ 1 << bit % 8]))
                f.flush()
                with pytest.raises(CorruptStoreError, match="checksum"):
                    store.verify()
                with pytest.raises(CorruptStoreError, match="checksum"):
                    store.get(ref)
                f.seek(at + bit // 8)
                f.write(raw[at + bit // 8 : at + bit // 8 + 1])
                f.flush()
        store.verify()
        np.testing.assert_array_equal(store.get(episode.close()), r)


def region_of(what: str) -> str:
    return what.split("[")[0].split(".")[0]


INTERESTING = [0, 1, 2, 3, -1, -2, 7, 8, 15, 16, 39, 40, 41, 64, 2**31 - 1, -(2**31), 2**32 - 1]


def live_spans(raw: bytes, spans) -> list[tuple[str, int, int]]:
    """The spans of published slots, used pages and the writer's lease record: what the
    checksums cover, and where a plausible change would change what is read back."""
    value = {what: int.from_bytes(raw[at : at + size], "little") for what, at, size in spans}
    live = {w.rsplit(".", 1)[0] for w in value if w.endswith((".state", ".refcount")) and value[w]}
    assert len(live) == 8 + 25 + 1  # 8 samples' slots, the 25 pages they use, the lease
    return [span for span in spans if span[0].rsplit(".", 1)[0] in live]


def corrupt(raw: bytes, spans, live, rng: np.random.Generator) -> tuple[bytes, list[str]]:
    """`raw` with 1-4 fields changed, half of them in published slots and used pages: a
    random byte, a flipped bit, a boundary value, or a nudge by a few (a plausible value,
    the kind only a checksum catches). Returns the bytes and what changed."""
    data = bytearray(raw)
    by_region: dict[str, list] = {}
    for span in spans:
        by_region.setdefault(region_of(span[0]), []).append(span)
    names = sorted(by_region)
    changes = []
    for _ in range(int(rng.integers(1, 5))):
        if rng.integers(2):
            what, at, size = live[int(rng.integers(len(live)))]
        else:
            spans_of = by_region[names[int(rng.integers(len(names)))]]
            what, at, size = spans_of[int(rng.integers(len(spans_of)))]
        how = int(rng.integers(4))
        if how == 0 or size > 8:  # a random byte (strings: in their first 24 bytes)
            i = at + int(rng.integers(min(size, 24)))
            data[i] = int(rng.integers(256))
            changes.append(f"{what} byte {i - at} = {data[i]}")
        elif how == 1:
            i = at + int(rng.integers(size))
            data[i] ^= 1 << int(rng.integers(8))
            changes.append(f"{what} byte {i - at} ^= bit")
        else:
            if how == 2:
                value = INTERESTING[int(rng.integers(len(INTERESTING)))]
                if size == 8 and rng.integers(2):
                    value = int(rng.choice([2**63 - 1, -(2**63), 2**62, 2**40]))
            else:
                delta = int(rng.choice([-4, -3, -2, -1, 1, 2, 3, 4]))
                value = int.from_bytes(data[at : at + size], "little", signed=True) + delta
            data[at : at + size] = (value % 2 ** (8 * size)).to_bytes(size, "little")
            changes.append(f"{what} = {value}")
    if rng.integers(3) == 0:  # a dead locker's flag: the next lock repairs over the damage
        at = HEADER_DTYPE.fields["dirty"][1]
        data[at : at + 4] = (1).to_bytes(4, "little")
        changes.append("header.dirty = 1")
    return bytes(data), changes


def exercise(name: str, samples, check_routes: bool) -> list[dict]:
    """Every operation on the store `name`, run in this (child) process: one outcome each."""
    outcomes: list[dict] = []

    def op(what: str, fn, check=None):
        outcome: dict = {"op": what}
        outcomes.append(outcome)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                value = fn()
            except Exception as e:
                outcome["error"] = type(e).__name__
                outcome["message"] = str(e)[:200]
                if not isinstance(e, RoutingReplayError):
                    outcome["violation"] = traceback.format_exc()
                return None
        noise = [str(w.message) for w in caught if "sweep skipped" not in str(w.message)]
        if noise:
            outcome["violation"] = f"warnings: {noise}"
        if check is not None and check_routes and (wrong := check(value)):
            outcome["violation"] = wrong
        return value

    def same(expected):
        return lambda got: None if np.array_equal(got, expected) else "wrong routes read back"

    live = [s for s in samples if s != "gone"]
    store = op("attach", lambda: RoutingStore.attach(name, put_timeout=PUT_TIMEOUT_S))
    if store is not None:
        for sid, (r, _, prompt_len) in samples.items():
            op(f"get {sid}", lambda sid=sid: store.get(sid), same(r))
            if prompt_len is not None:
                op(f"get {sid} completion", lambda sid=sid: store.get(sid, "completion"),
                   same(r[prompt_len:]))  # fmt: skip
        expected = b"".join(LAYOUT.encode(samples[s][0]).tobytes() for s in live)
        out = np.zeros(len(expected), dtype=np.uint8)

        def read_check(batch):
            ids = batch.column("sample_id").to_pylist()
            ok = ids == live and out.tobytes() == expected
            return None if ok else "wrong routes read back by read()"

        op("read", lambda: store.read(live, out=out), read_check)
        op("stats", store.stats)
        op("verify", store.verify)
        for sid in [*samples, "never-put"]:
            op(f"in {sid}", lambda sid=sid: sid in store)
        op("len", lambda: len(store))
        new_routes, new_tokens = new_sample()
        op("put new", lambda: store.put("new", new_routes, token_ids=new_tokens))
        op("get new", lambda: store.get("new"), same(new_routes))
        op("release p0-s1", lambda: store.release(["p0-s1"]))
        for sid in live:
            if sid != "p0-s1":
                op(f"get {sid} after", lambda sid=sid: store.get(sid), same(samples[sid][0]))
        op("verify after", store.verify)
    op("ls", lambda: [cli_module._row(i) for i in list_stores(prefix=name)])
    op("ls --verify", lambda: cli_module._verify(name))
    op("sweep --dry-run", lambda: sweep_stores(dry_run=True, prefix=name))
    if store is not None:
        op("close", store.close)
    return outcomes


def run_child(name: str, samples, check_routes: bool) -> list[dict]:
    """`exercise` in a forked child with a hard timeout; a hang or a crash is an outcome."""
    receive, send = FORK.Pipe(duplex=False)

    def child() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            send.send(exercise(name, samples, check_routes))

    p = FORK.Process(target=child)
    p.start()
    send.close()
    try:
        if not receive.poll(CHILD_TIMEOUT_S):
            return [{"op": "child", "violation": f"hung past {CHILD_TIMEOUT_S}s"}]
        try:
            return receive.recv()
        except EOFError:
            p.join(5)
            return [{"op": "child", "violation": f"died with exit code {p.exitcode}"}]
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)
        receive.close()


def fuzz_trials(name, samples, raw, spans, live, data_at, trials) -> list:
    """Each trial's damaged copy of `raw` at `<name>.f<trial>`, exercised by a child:
    (trial, changes, outcomes) per trial. The copies stay for the caller to remove."""
    out = []
    for trial in trials:
        rng = np.random.default_rng([7, trial])
        data, changes = corrupt(raw, spans, live, rng)
        check_routes = trial % 8 != 7
        if not check_routes:  # page data is not checksummed: routes may change, no more
            data = bytearray(data)
            for i in data_at + rng.integers(0, len(raw) - data_at, 4):
                data[i] = int(rng.integers(256))
            changes.append("4 bytes of page data")
        write_segment(segment_path(f"{name}.f{trial:04d}"), bytes(data))
        out.append((trial, changes, run_child(f"{name}.f{trial:04d}", samples, check_routes)))
    return out


def make_fuzz_store(name: str, samples) -> bytes:
    store = RoutingStore.create(
        name, LAYOUT, capacity_tokens=160, page_tokens=P, max_samples=16, max_writers=4
    )
    for sid, (r, tokens, prompt_len) in samples.items():
        store.put(sid, r, token_ids=tokens, prompt_len=prompt_len)
    store.release(["gone"])
    store.verify()
    s = store.stats()
    assert (s.samples, s.pages_total) == (len(samples) - 1, 40)
    assert s.dedup_saved_bytes == 3 * 4 * P * LAYOUT.bytes_per_token  # p0 x2, p1 x2 shared
    store.close()  # the segment stays; its owner lease is free
    with open(segment_path(name), "rb") as f:
        raw = f.read()
    os.unlink(segment_path(name))
    return raw


@pytest.mark.stress
def test_corrupted_tables_never_crash_hang_or_serve_wrong_routes(name):
    samples = fuzz_samples()
    raw = make_fuzz_store(name, samples)
    spans = field_spans(raw)
    live = live_spans(raw, spans)
    data_at = regions(LAYOUT.bytes_per_token, P, 40, 16, 64, 16, 4)["data"]
    write_segment(segment_path(name + ".clean"), raw)  # untouched: every operation passes
    clean = run_child(name + ".clean", samples, True)
    remove(segment_path(name + ".clean"))
    assert [(o["op"], o.get("error")) for o in clean if "error" in o or "violation" in o] == [
        ("get gone", "SampleNotFoundError"),
        ("get gone completion", "SampleNotFoundError"),
    ]

    started = time.monotonic()
    violations, counts, kept = [], {}, []
    try:
        # Two lean workers (a fork of this pytest process costs 3x more), trials interleaved.
        fuzz = (name, samples, raw, spans, live, data_at)
        args = [(*fuzz, range(i, FUZZ_TRIALS, 2)) for i in (0, 1)]
        trials = sorted(t for part in in_lean_workers(fuzz_trials, args) for t in part)
        for trial, changes, outcomes in trials:
            for o in outcomes:
                result = "VIOLATION" if "violation" in o else o.get("error", "ok")
                op = counts.setdefault(o["op"].split(" ")[0], {})
                op[result] = op.get(result, 0) + 1
                if "violation" in o:
                    violations.append((trial, changes, o["op"], o["violation"]))
            raised = any(o.get("error") == "CorruptStoreError" for o in outcomes)
            path = segment_path(f"{name}.f{trial:04d}")
            if raised and "error" not in outcomes[0] and len(kept) < 6:
                kept.append(path)  # attaches, but corrupt: for the real CLI below
            else:
                remove(path)
        elapsed = time.monotonic() - started
        print(f"\n{FUZZ_TRIALS} trials in {elapsed:.1f}s: {counts}")
        kinds = {}  # one example per (operation, last line of the violation)
        for t, c, op, v in violations:
            kinds.setdefault((op.split(" ")[0], v.strip().splitlines()[-1]), (t, c, v))
        shown = "\n\n".join(f"{k}: trial {t} {c}\n{v}" for k, (t, c, v) in kinds.items())
        assert violations == [], f"{len(violations)} violations, by kind:\n{shown}"
        # The fuzz got past attach, and met damage, often enough to mean something.
        assert counts["attach"]["ok"] >= FUZZ_TRIALS * 3 // 4
        assert counts["get"]["CorruptStoreError"] >= FUZZ_TRIALS // 10
        assert counts["verify"]["CorruptStoreError"] >= FUZZ_TRIALS // 4
        assert len(kept) == 6

        # The real CLI over stores that attach but are corrupt: listed, exit 0, no traceback.
        out = cli("ls", "--verify")
        assert (out.returncode, out.stderr) == (0, ""), out.stderr
        rows = out.stdout.splitlines()
        for path in kept:
            assert any(row.startswith(f"{os.path.basename(path)[3:]} ") for row in rows)
        assert "is corrupt" in out.stdout
        out = cli("sweep", "--dry-run")
        assert (out.returncode, out.stderr) == (0, ""), out.stderr
        for path in kept:  # ours, their owner gone: sweep would remove them
            assert f"would remove {path} (its owner, pid {os.getpid()}, is dead)" in out.stdout
    finally:
        remove(*kept, *(segment_path(f"{name}.f{t:04d}") for t in range(FUZZ_TRIALS)))


# -- an error inside `with` is the error, not a failed close -----------------------------------


def poke(path: str, changes: dict[str, int]) -> None:
    """Write integer fields of a closed segment, named as `field_spans` names them."""
    with open(path, "rb") as f:
        spans = {what: (at, size) for what, at, size in field_spans(f.read())}
    fd = os.open(path, os.O_RDWR)
    try:
        for what, value in changes.items():
            at, size = spans[what]
            os.pwrite(fd, (value % 2 ** (8 * size)).to_bytes(size, "little"), at)
    finally:
        os.close(fd)


CHECKSUM = "fails its checksum"
WITH_CASES = {  # changed fields, the operation, what it raises
    "get": ({"pages[0].gen": 99}, lambda s: s.get("s"), CHECKSUM),
    "read": ({"pages[1].gen": 99}, lambda s: s.read(["s"]), CHECKSUM),
    "release": ({"pages[2].parent": 7}, lambda s: s.release(["s"]), "out of range|has a parent"),
    "stats": ({"header.dirty": 1, "pages[0].gen": 99}, lambda s: s.stats(), CHECKSUM),
    "in": ({"header.dirty": 1, "slots[0].num_tokens": 99}, lambda s: "s" in s, "slot 0: 99"),
    "put": (
        {"header.dirty": 1, "pages[0].gen": 99},
        lambda s: s.put("t", routes(6, 3)),
        CHECKSUM,
    ),
    "verify chain": ({"pages[0].gen": 99}, lambda s: s.verify(), CHECKSUM),
    "verify counters": ({"header.tokens": 10}, lambda s: s.verify(), "header tokens=10"),
    "put, a dead writer's pages": (
        lambda: {
            "header.free_pages": 16,
            "header.pages_reserved": 1,
            "pages[15].owner": os.getpid() % 1024 + 1,
        },
        lambda s: s.put("t", routes(6, 3)),
        "more pages than the store has",
    ),
}


@pytest.mark.parametrize("case", list(WITH_CASES))
def test_corrupt_error_inside_with_is_raised_not_masked_by_close(name, case):
    changes, operation, message = WITH_CASES[case]
    closed_store(name, routes(5, 9))  # "s": pages 0, 1, 2 of 16
    # (a writer's lease is the first free one from its pid: this process's, for the put)
    poke(segment_path(name), changes() if callable(changes) else changes)
    with pytest.raises(CorruptStoreError, match=message), RoutingStore.attach(name) as store:
        operation(store)
    assert store._core.segment.fd == -1  # and __exit__ closed the handle


# -- directed damage: what the fuzz meets only now and then ---------------------------------


def keyed_store(name: str) -> None:
    """A closed store holding "k" (3 pages, 2 of them shareable: keyed by token ids)."""
    store = RoutingStore.create(name, LAYOUT, capacity_tokens=64, page_tokens=4)
    store.put("k", routes(8, 9), token_ids=np.arange(9))
    store.close()


DIRECTED = {  # changed fields, the operation, what it raises, the samples left after repair
    "counter at int64 max": (
        {"header.pages_used": 2**63 - 1},
        lambda s: s.put("t", routes(6, 3)),
        r"header pages_used=9223372036854775807, \+1 leaves it negative or huge",
        {"k"},  # the put raised before its commit point: nothing of it stays
    ),
    "counter below 0": (
        {"header.tokens": 3},
        lambda s: s.release(["k"]),
        r"header tokens=3, -9 leaves it negative or huge",
        set(),  # released (the commit point) before the counter broke
    ),
    "page bucket head out of range": (
        {f"page_heads[{i}]": 51716 for i in range(16)},
        lambda s: s.release(["k"]),
        r"page bucket 51716 outside \[0, 16\)",
        set(),
    ),
}


@pytest.mark.parametrize("case", list(DIRECTED))
def test_directed_damage_raises_corrupt_and_the_store_heals(name, case):
    changes, operation, message, left = DIRECTED[case]
    keyed_store(name)
    poke(segment_path(name), changes)
    store = RoutingStore.attach(name)
    try:
        with pytest.raises(CorruptStoreError, match=message):
            operation(store)
        store.verify()  # the lock repaired what the failed change left: consistent again
        stored = {"k": routes(8, 9), "t": routes(6, 3)}
        assert {s for s in stored if s in store} == left
        for sid in left:
            assert np.array_equal(store.get(sid), stored[sid])
    finally:
        store.close()
