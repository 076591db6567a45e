"""Kill and resume: a job's buffered rollouts, saved with its checkpoint, are replayed exactly
by a new job after the whole first one (driver, actors, Ray) was SIGKILLed.

`examples/resume_ray_job.py` runs twice, each time against its own `ray.cluster_utils`
cluster (what `ray job submit` gives an entrypoint): the first run holds after writing its
checkpoint and is killed with its cluster; its store's segment is then dead (owner gone)
and swept, so nothing of the first job's shared memory remains. The second run loads the
archive into a new store and trains the buffered samples under replay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from routing_replay.store import list_stores, sweep_stores

pytestmark = pytest.mark.ray

pytest.importorskip("ray")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "resume_ray_job.py")


def cluster():
    from ray.cluster_utils import Cluster

    return Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 80 * 2**20}
    )


def env(address: str) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out["PYTHONPATH"] = os.pathsep.join([ROOT, out.get("PYTHONPATH", "")])
    return {**out, "RAY_ADDRESS": address}


def resume(ckpt, out, address: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, EXAMPLE, "--checkpoint", str(ckpt), "--resume", "--out", str(out)],
        cwd=ROOT,
        env=env(address),
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_buffered_rollouts_replay_exactly_after_the_job_was_killed(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = cluster()
    try:
        proc = subprocess.Popen(
            [sys.executable, EXAMPLE, "--checkpoint", str(ckpt), "--hold"],
            cwd=ROOT,
            env=env(first.address),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.strip() == "HOLDING" or (not line and proc.poll() is not None):
                break
        assert lines[-1].strip() == "HOLDING", "".join(lines)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, at once
        proc.wait()
    finally:
        first.shutdown()  # every actor of the job with it: store actors, trainer
    with open(ckpt / "buffer.pkl", "rb") as f:
        import pickle

        old_refs = pickle.load(f)["refs"]
    old = {r.store for r in old_refs}
    # The first job's routes are gone with it: its segment's owner is dead; sweep it.
    time.sleep(0.5)
    dead = [s for s in list_stores() if s.name in old]
    assert dead and not any(s.owner_alive for s in dead)
    sweep_stores(min_age_s=0, prefix=next(iter(old)).split(".")[0])
    assert not [s for s in list_stores() if s.name in old]

    second = cluster()
    try:
        out = tmp_path / "resumed.json"
        done = resume(ckpt, out, second.address)
        assert done.returncode == 0, done.stdout + done.stderr
        m = json.loads(out.read_text())
        assert m["resumed"] == len(old_refs) == 16 and m["rollouts"] == 0
        assert m["agreement"] == 1.0 and m["exact"]
        assert m["new_store"] not in old and m["stored_after"] == 0
        # Without the archive there is nothing to resume from: the run fails, loudly.
        os.unlink(ckpt / "routes.arrow")
        failed = resume(ckpt, tmp_path / "none.json", second.address)
        assert failed.returncode != 0
        assert "InvalidArgumentError" in failed.stderr and "no archive file at" in failed.stderr
    finally:
        second.shutdown()
