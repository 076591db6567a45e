"""Ray's private APIs that the store actors use. Checked on Ray 2.54 - 2.60."""

from __future__ import annotations

from typing import Any


def named_actor(name: str, namespace: str) -> Any | None:
    """The actor named `name` in `namespace`, or None if it is gone. An actor still listed by
    name as it dies, after the GCS deleted its Ray job's class record, makes
    `ray.get_actor` fail inside Ray with an AssertionError (Ray 2.60) instead of ValueError."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except (ValueError, AssertionError):
        return None


def job_table() -> list[dict[str, Any]] | None:
    """Every Ray job the GCS knows, as `ray._private.state.jobs()` gives them (`JobID` hex,
    `IsDead`): the only way to see a job's state without the dashboard (the job submission
    client needs it). None if this Ray has no such function."""
    try:
        from ray._private.state import jobs
    except ImportError:
        return None
    return jobs()
