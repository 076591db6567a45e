"""Ray Train with routing replay: TorchTrainer workers read their shard's routes, replay, step.

    python examples/ray_train.py                        # both read paths, FSDP2, local Ray
    python examples/ray_train.py --read refs --out result.json

Two bfloat16 rollout workers sample completions of a tiny Qwen3-MoE under `capture` and
put the routes into the node store; the driver keeps tokens and `RoutingRef`s and computes
GRPO advantages. Then a `ray.train.torch.TorchTrainer` (2 CPU workers, gloo, the float32
model under FSDP2 `fully_shard`) trains one GRPO pass over the rollout, each worker
reading only its own data-parallel shard of the routes, in one of two ways:

- `--read refs`: the refs travel in `train_loop_config`; worker `rank` takes
  `refs[rank::world]` and reads each mini-batch with `fetch_batch(refs, ranges=...)`:
  every sample cut to the trainer's `--max-seq-len` tokens, so only those tokens' routes
  are read (a context-parallel rank would pass its chunks here instead).
- `--read dataset`: the driver builds `read_dataset(refs)` and passes it as
  `datasets={"train": ds}`; each worker iterates `ray.train.get_dataset_shard("train")`
  with `iter_torch_batches(collate_fn=routes_collate_fn())` (whole samples, packed), checks
  the token ids against its own and cuts them to `--max-seq-len` after the read.

Each worker measures, at the experts (a forward pre-hook on every MoE layer's `experts`
module: the ids the experts were called with), how often its float32 routing agrees with
the rollout's without replay and with it, runs forward and backward under `replay`, steps
SGD, and reports each step to Ray Train: `ray.train.report({"step", "loss", **replay's
metrics})` on every worker, which Ray Train hands to the run's `UserCallback`s, its
loggers: `StepLog` combines the workers' step (`replay/rows_replayed`, `replay/rows_missing`
summed, `replay/native_agreement`, `replay/replace_rate` weighted by rows replayed) and
appends it to a JSON-lines file, where a W&B or MLflow callback would log it. The last
report carries a `ray.train.Checkpoint` (rank 0 writes the full model state dict, every
rank the list of samples it trained on; Ray Train merges the files) and the run's metrics
(rank 0's carry every rank's, gathered with `all_gather_object`; replay's combined over
steps and workers). `--replay-tolerance r` replays with `tolerance=r`.
Exit status 0 only if every sample was trained by exactly one worker, replay reproduced
every recorded route at the experts (without a tolerance), losses are finite and every
sample was released.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np
import ray
import ray.train
import torch

from routing_replay import RoutingLayout, replay, to_torch, with_layout
from routing_replay.errors import TokenMismatchError
from routing_replay.integrations.replay_metrics import combine
from routing_replay.model.agreement import routing_agreement
from routing_replay.ray import (
    StoreOptions,
    fetch_batch,
    read_dataset,
    rollout_worker,
    routes_collate_fn,
    shutdown_node_stores,
    store_actors,
)
from routing_replay.testing import (
    group_advantages,
    grpo_loss,
    make_prompts,
    right_padded,
    start_ray,
    tiny_moe,
)

VOCAB = 128  # tiny_moe's vocabulary; token ids >= 3 are ordinary tokens
WORLD = 2  # Ray Train workers (data-parallel ranks)


# -- the rollout side (as in examples/ray_job.py) ---------------------------------------------


def rollout(job: str, num_prompts: int, n: int, max_new_tokens: int, seed: int) -> list[Any]:
    """Two bfloat16 rollout workers generate under capture; returns their `Rollout`s."""
    model_fn = functools.partial(tiny_moe, seed, torch.bfloat16)  # the "inference engine"
    workers = [
        rollout_worker(job, model_fn, num_cpus=0.5, store_options=StoreOptions(page_tokens=16))
        for _ in range(2)
    ]
    prompts = make_prompts(num_prompts, seed)
    shares = np.array_split(np.arange(num_prompts), len(workers))
    pending = [
        w.generate.remote(
            [prompts[i] for i in share],
            n=n,
            max_new_tokens=max_new_tokens,
            first_prompt_index=int(share[0]),
            seed=seed + k,
        )
        for k, (w, share) in enumerate(zip(workers, shares, strict=True))
        if len(share)
    ]
    rollouts = [r for part in ray.get(pending) for r in part]
    for w in workers:  # free their CPUs for the trainer
        ray.kill(w)
    return rollouts


# -- the training side: runs in each Ray Train worker -----------------------------------------


class ExpertsSpy:
    """The expert ids each MoE layer's `experts` module is called with (Qwen3-MoE blocks:
    `experts(hidden [B*S, H], top_k_index [B*S, K], top_k_weights)`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from routing_replay.model.adapters import find_routers

        names = [r.name.rsplit(".", 1)[0] for r in find_routers(model).routers]
        self.calls: list[list[torch.Tensor]] = [[] for _ in names]
        for j, name in enumerate(names):
            model.get_submodule(name).experts.register_forward_pre_hook(
                lambda _m, args, j=j: self.calls[j].append(args[1].detach().clone())
            )

    def routes(self, mask: torch.Tensor) -> np.ndarray:
        """`[N, L, K]` ids of the last forward at the mask's tokens; then forget them."""
        B, S = mask.shape
        per_layer = [calls[-1].reshape(B, S, -1)[mask.bool()] for calls in self.calls]
        for calls in self.calls:
            calls.clear()
        return torch.stack(per_layer, 1).numpy()


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: `fully_shard` per decoder layer, then the root, on Ray's gloo group."""

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ray.train.get_context().get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on every rank (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def refs_batches(config: dict, rank: int, world: int):
    """Path (a): this rank's refs, `refs[rank::world]`, read mini-batch by mini-batch with
    `fetch_batch(ranges=...)`: only the first `max_seq_len` tokens of each sample."""
    mine = config["refs"][rank::world]
    steps = config["steps"]
    if len(mine) < steps:
        raise ValueError(f"rank {rank} has {len(mine)} samples for {steps} steps")
    max_len = config["max_seq_len"]
    for chunk in np.array_split(np.arange(len(mine)), steps):
        refs = [mine[i] for i in chunk]
        ranges = [(0, min(r.num_tokens, max_len)) for r in refs]
        t0 = time.perf_counter()
        batch = fetch_batch(refs, ranges=ranges, release=True)  # each sample read once: release
        read_s = time.perf_counter() - t0
        sample_ids = batch.column("sample_id").to_pylist()
        ids, mask = right_padded([config["tokens"][s][:max_len] for s in sample_ids])
        routes = to_torch(batch, attention_mask=mask, input_ids=ids)  # tokens checked
        yield sample_ids, ids, mask, routes, read_s, sum(batch.column("num_tokens").to_pylist())


def dataset_batches(config: dict, rank: int, world: int):
    """Path (b): this rank's Ray Data shard, packed by `routes_collate_fn`; whole samples
    are read, checked against this worker's tokens, then cut to `max_seq_len`."""
    shard = ray.train.get_dataset_shard("train")
    max_len = config["max_seq_len"]
    batches = iter(
        shard.iter_torch_batches(batch_size=config["batch_size"], collate_fn=routes_collate_fn())
    )
    while True:
        t0 = time.perf_counter()
        b = next(batches, None)
        read_s = time.perf_counter() - t0
        if b is None:
            return
        sample_ids, packed = b["sample_ids"], b["routes"]  # [sum_T, L, K], layout attached
        seqs = [np.asarray(config["tokens"][s]) for s in sample_ids]
        ids, mask = right_padded([seq[:max_len] for seq in seqs])
        padded = torch.full((*ids.shape, *packed.shape[1:]), -1, dtype=packed.dtype)
        spans = itertools.pairwise(b["cu_seqlens"].tolist())
        for row, (s, seq, (lo, hi)) in enumerate(zip(sample_ids, seqs, spans, strict=True)):
            if not np.array_equal(b["token_ids"][lo:hi].numpy(), seq):  # as to_torch(input_ids=)
                raise TokenMismatchError(f"sample {s!r}: its routes were put with other tokens")
            n = min(hi - lo, max_len)
            padded[row, :n] = packed[lo : lo + n].as_subclass(torch.Tensor)
        routes = with_layout(padded, packed.layout)
        yield sample_ids, ids, mask, routes, read_s, packed.shape[0]  # whole samples read


def model_layout(model: torch.nn.Module) -> RoutingLayout:
    """The model's routing layout. (Kept out of `train_loop_per_worker`: cloudpickle pickles
    `torch.distributed.config` by value, and fails, for a `__main__` function that both
    imports `torch.distributed` and reads an attribute named `config`.)"""
    return RoutingLayout.from_hf_config(model.config)


def train_loop_per_worker(config: dict) -> list[dict]:
    """One GRPO pass over this worker's shard under replay; reports metrics and a checkpoint."""

    import torch.distributed as dist

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = tiny_moe(config["seed"], torch.float32).train()  # the same init on every rank
    layout = model_layout(model)
    spy = ExpertsSpy(model)  # before wrapping: module names are the model's own
    model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    read = refs_batches if config["read"] == "refs" else dataset_batches
    trained, losses, read_s, read_tokens, tokens = [], [], [], 0, 0
    recorded, native, replayed, replay_steps = [], [], [], []
    for sample_ids, ids, mask, routes, t, n in read(config, rank, world):
        trained += sample_ids
        read_s.append(t)
        read_tokens, tokens = read_tokens + n, tokens + int(mask.sum())
        recorded.append(routes.as_subclass(torch.Tensor)[mask.bool()].numpy())  # [N, L, K]
        with torch.no_grad():  # the trainer's own routing, for comparison
            model(input_ids=ids, attention_mask=mask)
        native.append(spy.routes(mask))
        opt.zero_grad()
        with replay(
            model, routes, attention_mask=mask, tolerance=config["replay_tolerance"]
        ) as block:
            logits = model(input_ids=ids, attention_mask=mask).logits
            prompt_lens = [config["prompt_len"][s] for s in sample_ids]
            adv = [config["advantage"][s] for s in sample_ids]
            loss = grpo_loss(logits, ids, mask, prompt_lens, adv)
            loss.backward()
        replay_steps.append(block.metrics())  # after backward: one host sync
        replayed.append(spy.routes(mask))
        opt.step()
        losses.append(float(loss))
        # Every worker reports every step: Ray Train hands the reports to StepLog.
        ray.train.report({"step": len(losses), "loss": losses[-1], **replay_steps[-1]})
    rec = np.concatenate(recorded)
    with_replay = routing_agreement(rec, np.concatenate(replayed), layout)
    mine = {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "sample_ids": trained,
        "num_samples": len(trained),
        "tokens": tokens,
        "losses": losses,
        # Per step: the second step's native routing follows the first step's update.
        "agreement_without_replay": [
            routing_agreement(rec_step, nat_step, layout).router_agreement
            for rec_step, nat_step in zip(recorded, native, strict=True)
        ],
        "agreement_with_replay": with_replay.router_agreement,
        "overlap_with_replay": with_replay.expert_overlap,
        "decisions": with_replay.num_decisions,
        "replay_steps": replay_steps,  # Replay.metrics() of each step's block
        "per_layer_with_replay": with_replay.per_layer.tolist(),
        "read_s": read_s,
        "read_tokens": read_tokens,  # tokens whose routes were read (trained: "tokens")
        "read_bytes": read_tokens * layout.bytes_per_token,  # as stored (uint8 ids)
    }
    workers: list[Any] = [None] * world
    dist.all_gather_object(workers, mine)  # only rank 0's report reaches Result.metrics
    state = full_state_dict(model)
    metrics = {
        "loss": float(np.mean(losses)),
        "agreement_with_replay": min(w["agreement_with_replay"] for w in workers),
        "samples": sum(w["num_samples"] for w in workers),
        # replay's own, over every step of every worker: rows summed, rates row-weighted
        **combine(step for w in workers for step in w["replay_steps"]),
        "workers": workers,
    }
    with tempfile.TemporaryDirectory() as tmp:  # Ray Train merges every rank's files
        with open(os.path.join(tmp, f"samples-rank{rank}.json"), "w") as f:
            json.dump(trained, f)
        if rank == 0:
            torch.save(state, os.path.join(tmp, "model.pt"))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    return workers


# -- the driver ---------------------------------------------------------------------------------


class StepLog(ray.train.UserCallback):
    """A logger of Ray Train's per-step reports: every worker's step combined (rows summed,
    rates weighted by rows replayed) as one JSON line. Runs in the run's controller, on the
    head node: on a cluster, write where the driver (or a logger service) can read."""

    def __init__(self, path: str) -> None:
        self.path = path

    def after_report(self, run_context: Any, metrics: list[dict], checkpoint: Any) -> None:
        if not metrics or "step" not in metrics[0]:
            return  # the final report: the checkpoint and the run's totals
        row = {
            "step": metrics[0]["step"],
            "loss": float(np.mean([m["loss"] for m in metrics])),
            **combine(metrics),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def read_step_log(path: str) -> list[dict]:
    """The rows `StepLog` wrote, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def fit(read: str, config: dict, storage: str, ds: Any = None) -> dict[str, Any]:
    """Run one TorchTrainer over the rollout with read path `read`; returns what it reported."""

    from ray.train.torch import TorchConfig, TorchTrainer

    step_log = os.path.join(storage, f"steps-{read}.jsonl")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={**config, "read": read},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=WORLD, use_gpu=False, resources_per_worker={"CPU": 1}
        ),
        run_config=ray.train.RunConfig(
            name=f"routes-{read}", storage_path=storage, callbacks=[StepLog(step_log)]
        ),
        datasets=None if ds is None else {"train": ds},
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    fit_s = time.perf_counter() - t0
    if result.error is not None:
        raise result.error
    return {
        **result.metrics,
        "checkpoint": result.checkpoint.path,
        "checkpoint_files": sorted(os.listdir(result.checkpoint.path)),
        "steps": read_step_log(step_log),  # what StepLog logged, one row per step
        "fit_s": fit_s,
    }


def stored_samples(job: str) -> int:
    """Samples still held by the job's node stores."""
    return sum(
        s["samples"] for s in ray.get([a.stats.remote() for a in store_actors(job).values()])
    )


def run(args: argparse.Namespace, job: str, storage: str) -> dict[str, Any]:
    """Roll out once, then train with each requested read path; returns the figures."""
    t0 = time.perf_counter()
    rollouts = rollout(job, args.prompts, args.n, args.max_new_tokens, args.seed)
    rollout_s = time.perf_counter() - t0
    refs = [r.ref for r in rollouts]
    rewards = np.array(  # toy reward: completion tokens in the lower half of the vocabulary
        [float((r.tokens[r.prompt_len :] < VOCAB // 2).mean()) for r in rollouts]
    )
    adv = group_advantages(rewards, args.n)
    per_rank = math.ceil(len(refs) / WORLD)
    config = {
        "seed": args.seed,
        "lr": 1e-2,
        "batch_size": args.batch_size,
        "steps": math.ceil(per_rank / args.batch_size),
        "max_seq_len": args.max_seq_len,
        "refs": refs,
        "tokens": {r.sample_id: r.tokens.tolist() for r in rollouts},
        "prompt_len": {r.sample_id: r.prompt_len for r in rollouts},
        "advantage": {r.sample_id: float(a) for r, a in zip(rollouts, adv, strict=True)},
        "replay_tolerance": args.replay_tolerance,
    }
    out: dict[str, Any] = {
        "samples": len(refs),
        "sample_ids": [r.sample_id for r in rollouts],
        "sample_tokens": sum(r.num_tokens for r in refs),
        "trained_tokens": sum(min(r.num_tokens, args.max_seq_len) for r in refs),
        "replay_tolerance": args.replay_tolerance,
        "rollout_s": rollout_s,
        "paths": {},
    }
    paths = ["refs", "dataset"] if args.read == "both" else [args.read]
    ds = None
    if "dataset" in paths:  # read before the refs path releases the samples
        if len(refs) % WORLD:
            # Ray Train's DataConfig splits with streaming_split(equal=True): the rows past a
            # multiple of the world size would be dropped, silently, and never trained.
            raise ValueError(
                f"{len(refs)} samples do not split evenly over {WORLD} workers: Ray Train "
                "would drop the remainder of the dataset; pad or trim the batch first"
            )
        t1 = time.perf_counter()
        ds = read_dataset(refs, release="refs" not in paths)  # blocks now in the object store
        out["read_dataset_s"] = time.perf_counter() - t1
    for read in paths:
        out["paths"][read] = fit(read, config, storage, ds if read == "dataset" else None)
    out["stored_after"] = stored_samples(job)
    out["total_s"] = time.perf_counter() - t0
    return out


def check(m: dict[str, Any]) -> list[str]:
    """What must hold; an empty list when everything does."""
    problems = []
    for read, p in m["paths"].items():
        ids = [s for w in p["workers"] for s in w["sample_ids"]]
        if len(ids) != len(set(ids)):
            problems.append(f"{read}: a sample was trained by more than one worker")
        if sorted(ids) != sorted(m["sample_ids"]):
            problems.append(f"{read}: the workers did not train every sample")
        exact = m["replay_tolerance"] is None  # a tolerance replaces some recorded experts
        if exact and any(w["agreement_with_replay"] != 1.0 for w in p["workers"]):
            problems.append(f"{read}: replay did not reproduce every route at the experts")
        if not all(math.isfinite(x) for w in p["workers"] for x in w["losses"]):
            problems.append(f"{read}: a loss is not finite")
        if "model.pt" not in p["checkpoint_files"]:
            problems.append(f"{read}: no model in the checkpoint")
    if m["stored_after"]:
        problems.append(f"{m['stored_after']} samples left in the stores")
    return problems


def summary(m: dict[str, Any]) -> str:
    """The figures of the run, for people."""
    lines = [
        f"routing_replay on Ray Train: {m['samples']} samples ({m['sample_tokens']} tokens, "
        f"{m['trained_tokens']} within the trainer's max_seq_len), TorchTrainer "
        f"{WORLD} workers, gloo, FSDP2; rollout {m['rollout_s']:.1f} s"
    ]
    for read, p in m["paths"].items():
        how = (
            "fetch_batch(refs[rank::world], ranges=)"
            if read == "refs"
            else "get_dataset_shard + iter_torch_batches(routes_collate_fn)"
        )
        extra = ""
        if read == "dataset":
            extra = f", read_dataset in the driver {m['read_dataset_s'] * 1e3:.0f} ms"
        lines.append(f"  read path {read}: {how}; fit {p['fit_s']:.1f} s{extra}")
        for w in p["workers"]:
            lines.append(
                f"    rank {w['rank']}: {w['num_samples']} samples ({w['tokens']} tokens trained), "
                f"routes of {w['read_tokens']} tokens read ({w['read_bytes']} B) in "
                + " + ".join(f"{t * 1e3:.1f}" for t in w["read_s"])
                + " ms; agreement at the experts without replay (per step) "
                + " ".join(f"{a:.4f}" for a in w["agreement_without_replay"])
                + f", with replay {w['agreement_with_replay']:.4f} ({w['decisions']} decisions)"
                + "; losses "
                + " ".join(f"{x:.4f}" for x in w["losses"])
            )
        for row in p["steps"]:
            lines.append(
                f"    step {row['step']} (Ray Train's reports, StepLog): loss {row['loss']:.4f}, "
                f"{row['replay/rows_replayed']} rows replayed, native agreement "
                f"{row['replay/native_agreement']:.4f}, replace rate "
                f"{row['replay/replace_rate']:.4f}"
            )
        lines.append(
            f"    replay (tolerance {m['replay_tolerance']}): {p['replay/rows_replayed']} rows "
            f"replayed, {p['replay/rows_missing']} missing, native agreement "
            f"{p['replay/native_agreement']:.4f}, replace rate {p['replay/replace_rate']:.4f}"
        )
        lines.append(f"    checkpoint {p['checkpoint']}: {', '.join(p['checkpoint_files'])}")
    lines.append(f"  samples left in the stores: {m['stored_after']}; total {m['total_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run and print the summary; exit status 0 when every check holds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read", choices=["refs", "dataset", "both"], default="both")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4, help="samples per step per rank")
    parser.add_argument("--max-seq-len", type=int, default=40, help="tokens trained per sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--replay-tolerance",
        type=float,
        help="replay(tolerance=r): keep a recorded expert the trainer scores >= r x its "
        "weakest own top-k expert, else its own (default: replay exactly)",
    )
    parser.add_argument("--storage", help="RunConfig storage_path (default: a temp dir)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    start_ray(num_cpus=4)  # logical CPUs: 1 per train worker, and headroom for Ray Data
    job = f"train-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        storage = args.storage or tmp
        try:
            m = run(args, job, storage)
        finally:
            shutdown_node_stores(job)
        m["wall_s"] = time.perf_counter() - start
        problems = check(m)
        m["ok"], m["problems"] = not problems, problems
        if args.out:
            with open(args.out, "w") as f:
                json.dump(m, f, indent=1)
        print(summary(m))
        print(f"  wall time including Ray start: {m['wall_s']:.1f} s")
    print("OK" if not problems else "FAILED: " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
