"""Names of the node store actors and their segments, and where a ref's store lives.

A store actor is `rr-store.<job>.<Ray job id>.<node id[:12]>` in the `routing_replay`
namespace; its segments are `<job>.<Ray job id>.<node id[:12]>.<incarnation>`. Ray is
imported inside the functions.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from routing_replay.compat.ray import named_actor
from routing_replay.errors import InvalidArgumentError, StoreUnavailableError
from routing_replay.store import RoutingRef

if TYPE_CHECKING:
    from ray.actor import ActorHandle

NAMESPACE = "routing_replay"
NODE_PREFIX = 12  # characters of Ray's 56-hex-digit node id kept in names
JOB_PATTERN = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


def check_job(job: str) -> str:
    if not isinstance(job, str) or not JOB_PATTERN.match(job):
        raise InvalidArgumentError(
            f"job {job!r} must be 1-64 characters from [A-Za-z0-9_-]: it names the store "
            "actors and their /dev/shm segments"
        )
    return job


def current_ray_job() -> str:
    """The hex id of the Ray job this process works for (driver, task or actor)."""
    import ray

    return ray.get_runtime_context().get_job_id()


def actor_name(job: str, ray_job: str, node_id: str) -> str:
    """Name of the store actor of `job` in Ray job `ray_job` on the Ray node `node_id`."""
    return f"rr-store.{check_job(job)}.{ray_job}.{node_id[:NODE_PREFIX]}"


def store_prefix(job: str, ray_job: str, node_id: str) -> str:
    return f"{check_job(job)}.{ray_job}.{node_id[:NODE_PREFIX]}."


def job_of(ref: RoutingRef) -> tuple[str, str]:
    """(job, Ray job id) of a ref's store (named `<job>.<Ray job>.<node>.<incarnation>`)."""
    parts = ref.store.split(".")
    if len(parts) != 4:
        raise StoreUnavailableError(
            f"ref {ref.sample_id!r} is in store {ref.store!r}, which no node store actor "
            "made: read it with RoutingStore.attach on its node"
        )
    return parts[0], parts[1]


def current_node_id() -> str:
    """Ray's id of the node this process runs on (driver, task or actor)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def lost_error(refs: list[RoutingRef], why: str) -> StoreUnavailableError:
    """The error for refs whose store is gone (its actor died and was restarted, or stopped)."""
    shown = ", ".join(repr(r.sample_id) for r in refs[:5])
    more = f" and {len(refs) - 5} more" if len(refs) > 5 else ""
    return StoreUnavailableError(
        f"samples {shown}{more} were stored in {refs[0].store!r} on node {refs[0].node_id[:12]}, "
        f"which no longer exists ({why}): the node's store actor died or was shut down and "
        "its samples are lost; roll those samples out again"
    )


def store_actors(job: str | None = None, *, every_ray_job: bool = False) -> dict[str, ActorHandle]:
    """Live store actors of `job` (or of every job) in this Ray job (or in every one), by name."""
    import ray

    ray_job = None if every_ray_job else current_ray_job()
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        parts = entry["name"].split(".")
        if (
            entry["namespace"] != NAMESPACE
            or len(parts) != 4
            or parts[0] != "rr-store"
            or (job is not None and parts[1] != check_job(job))
            or (ray_job is not None and parts[2] != ray_job)
        ):
            continue
        handle = named_actor(entry["name"], NAMESPACE)
        if handle is not None:
            found[entry["name"]] = handle
    return found
