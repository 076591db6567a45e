"""The examples run end to end: the Ray job (own local Ray, a running cluster), the notebook."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

pytest.importorskip("ray")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _check_summary(out: str) -> None:
    assert "routing agreement with replay: 1.0000" in out, out
    assert "after the trainer consumed them: 0 samples, 0 pages" in out, out
    assert out.rstrip().endswith("OK"), out


def test_ray_job_runs_with_its_own_local_ray():
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "ray_job.py")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_summary(proc.stdout)


def test_ray_job_joins_a_running_cluster():
    """What `ray job submit` does: the entrypoint runs with RAY_ADDRESS of the cluster."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": 80 * 2**20},
    )
    try:
        proc = subprocess.run(
            [sys.executable, "examples/ray_job.py", "--prompts", "4"],
            cwd=ROOT,
            env=_env(RAY_ADDRESS=cluster.address),
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        cluster.shutdown()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_summary(proc.stdout)


def test_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    path = os.path.join(EXAMPLES, "routing_replay.ipynb")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}}
    )
    client.execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "with replay:    1.0000" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2
