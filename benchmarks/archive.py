"""Route archives: save_routes / load_routes against writing and reading the same bytes with
numpy's tofile / fromfile, and the memory a save needs.

    python benchmarks/archive.py            # 2 GiB of Qwen3-30B-A3B routes: 512 x 10,922 tokens
    python benchmarks/archive.py --quick    # 64 MiB, the same path

One process: a store holding the samples (token ids too, so the archive carries them), then
- tofile / fromfile: the stored narrow ids (and token ids) as one numpy array, written to
  and read from a file in the same directory (the disk's speed for these bytes);
- save_routes(read=store.read): chunked reads out of the store into an Arrow IPC file;
- load_routes into a second, empty store (CRC check pass, then put_many per batch).
Each write is fsynced and each file dropped from the page cache before it is read back
(posix_fadvise DONTNEED), best of `--repeat`. Peak private memory (RssAnon, sampled every
5 ms by a thread) above its level before the call: what saving 2 GiB needs beyond the
store. Checks that the loaded store reads back equal to the source. Writes
benchmarks/results/archive.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import uuid
from pathlib import Path

import numpy as np
from harness import MB, RESULTS, layout_of_model, machine, timed, write_json

from routing_replay import RoutingStore, load_routes, save_routes


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """Peak RssAnon while the block runs, above its level at the start (5 ms sampling)."""

    def __enter__(self) -> PeakAnon:
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
        self.extra = self.peak - self.base


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsynced_tofile(array: np.ndarray, path: str) -> None:
    with open(path, "wb") as f:
        array.tofile(f)
        f.flush()
        os.fsync(f.fileno())


def run(samples: int, tokens: int, repeat: int, directory: str) -> dict:
    layout = layout_of_model("qwen3-30b-a3b")  # 384 B a token
    rng = np.random.default_rng(0)
    total = samples * tokens
    name = f"bench-archive-{uuid.uuid4().hex[:8]}"
    capacity = samples * -(-tokens // 128) * 128 + 1024  # whole pages of 128 tokens a sample
    src = RoutingStore.create(name, layout, capacity_tokens=capacity)
    dst = RoutingStore.create(name + "-dst", layout, capacity_tokens=capacity)
    try:
        one = layout.random_routes(rng, tokens, np.uint8)
        refs = [
            src.put(f"s{i}", one, token_ids=rng.integers(0, 150_000, tokens))
            for i in range(samples)
        ]
        # What numpy writes: the same narrow ids and int32 token ids, one array each.
        whole = src.read(refs)
        ids = np.frombuffer(whole.column("routed_experts").values.values.buffers()[1], np.uint8)
        toks = whole.column("token_ids").values.to_numpy()
        raw_bytes = ids.nbytes + toks.nbytes
        npy, arc = os.path.join(directory, "raw.bin"), os.path.join(directory, "routes.arrow")

        def tofile() -> None:
            fsynced_tofile(ids, npy)
            fsynced_tofile(toks, npy + ".tok")

        held: list[np.ndarray] = []  # what a read returned, freed outside the timing

        def drop() -> None:
            held.clear()
            drop_cache(npy)
            drop_cache(npy + ".tok")

        def fromfile() -> None:
            held.extend((np.fromfile(npy, np.uint8), np.fromfile(npy + ".tok", np.int32)))

        def t_save() -> tuple[float, int]:
            with PeakAnon() as peak:
                (took,) = timed(lambda: save_routes(arc, refs, read=src.read))
            return took, peak.extra

        def t_load() -> tuple[float, int]:
            drop_cache(arc)
            new: list = []
            with PeakAnon() as peak:
                (took,) = timed(lambda: new.extend(load_routes(arc, dst)))
            assert len(new) == samples
            dst.release(new)
            return took, peak.extra

        tofile_s = min(timed(tofile, repeat))
        fromfile_s = min(timed(fromfile, repeat, setup=drop))
        assert sum(a.nbytes for a in held) == raw_bytes
        held.clear()
        saves = [t_save() for _ in range(repeat)]
        loads = [t_load() for _ in range(repeat)]
        new = load_routes(arc, dst)
        assert dst.read(new[:4]).equals(src.read(refs[:4]))  # exact round trip
        assert dst.read(new[-4:]).equals(src.read(refs[-4:]))
        archive_bytes = os.path.getsize(arc)
        dst.release(new)
    finally:
        for store in (src, dst):
            store.close()
            store.unlink()
    save_s = min(s for s, _ in saves)
    load_s = min(s for s, _ in loads)
    return {
        "samples": samples,
        "tokens_per_sample": tokens,
        "routes_bytes": total * layout.bytes_per_token,
        "raw_bytes": raw_bytes,
        "archive_bytes": archive_bytes,
        "tofile_seconds": tofile_s,
        "fromfile_seconds": fromfile_s,
        "save_seconds": save_s,
        "load_seconds": load_s,
        "save_over_tofile": save_s / tofile_s,
        "load_over_fromfile": load_s / fromfile_s,
        "save_peak_anon_bytes": max(m for _, m in saves),
        "load_peak_anon_bytes": max(m for _, m in loads),
        "repeat": repeat,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    samples, tokens = (64, 2731) if args.quick else (512, 10_922)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        r = run(samples, tokens, args.repeat, directory)
    r["machine"] = machine()
    print("| | seconds | MiB/s | ratio | peak private MiB |")
    print("|---|---|---|---|---|")
    raw = r["raw_bytes"] / MB
    print(f"| tofile (routes + token ids) | {r['tofile_seconds']:.2f} | "
          f"{raw / r['tofile_seconds']:.0f} | 1.00 | |")  # fmt: skip
    print(f"| save_routes | {r['save_seconds']:.2f} | {raw / r['save_seconds']:.0f} | "
          f"{r['save_over_tofile']:.2f} | {r['save_peak_anon_bytes'] / MB:.0f} |")  # fmt: skip
    print(f"| fromfile | {r['fromfile_seconds']:.2f} | {raw / r['fromfile_seconds']:.0f} | "
          "1.00 | |")  # fmt: skip
    print(f"| load_routes | {r['load_seconds']:.2f} | {raw / r['load_seconds']:.0f} | "
          f"{r['load_over_fromfile']:.2f} | {r['load_peak_anon_bytes'] / MB:.0f} |")  # fmt: skip
    print(f"{r['samples']} samples x {r['tokens_per_sample']} tokens: {r['routes_bytes'] / MB:.0f}"
          f" MiB of routes, archive {r['archive_bytes'] / MB:.0f} MiB")  # fmt: skip
    out = args.out or (
        Path(tempfile.gettempdir()) / "archive.quick.json"
        if args.quick
        else RESULTS / "archive.json"
    )
    write_json(out, r, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
