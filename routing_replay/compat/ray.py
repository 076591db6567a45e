"""Ray's private APIs that the store actors use. Checked on Ray 2.54 - 2.60."""

from __future__ import annotations

from typing import Any


def job_table() -> list[dict[str, Any]] | None:
    """Every Ray job the GCS knows, as `ray._private.state.jobs()` gives them (`JobID` hex,
    `IsDead`): the only way to see a job's state without the dashboard (the job submission
    client needs it). None if this Ray has no such function."""
    try:
        from ray._private.state import jobs
    except ImportError:
        return None
    return jobs()
