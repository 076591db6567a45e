"""A NeMo-RL-style trainer step with rollout routing replay, on one machine.

    python examples/nemo_rl_style.py

A bfloat16 copy of a tiny Qwen3-MoE plays the inference engine: it samples n completions
per prompt under `capture`, and the routes go into a RoutingStore with the token ids (the
n samples share their prompt pages). The trainer gets a NeMo-RL-style batch dict
(`input_ids` [B, S] right padded, `input_lengths` [B], `routing_refs`), attaches the routes
aligned with `input_ids`, measures how often its own float32 routing agrees with the
rollout's, and runs a GRPO-style update under `replay`. It then shows what one rank of a
CP=2 x TP=2 (sequence parallel) Megatron job would receive from the packed batch.
"""

from __future__ import annotations

import uuid

import torch

from routing_replay import RoutingLayout, RoutingStore, capture, replay
from routing_replay.integrations.nemo_rl import (
    attach_routes,
    input_ids_for_rank,
    pack,
    read_rank_routes,
    routes_for_rank,
)
from routing_replay.model.agreement import routing_agreement
from routing_replay.testing import tiny_moe

N, PROMPT_LEN, NEW_TOKENS = 4, 12, 10


def rollout(store: RoutingStore, engine: torch.nn.Module, prompts: torch.Tensor) -> list:
    """Sample N completions per prompt with the bf16 'engine'; routes into the store."""
    torch.manual_seed(0)
    rows = prompts.repeat_interleave(N, dim=0)
    with capture(engine) as cap, torch.no_grad():
        engine.generate(
            input_ids=rows,
            attention_mask=torch.ones_like(rows),
            max_new_tokens=NEW_TOKENS,
            do_sample=True,
            top_k=0,
            pad_token_id=0,
        )
    samples = []
    for b, (routes, tokens) in enumerate(zip(cap.routes(), cap.token_ids(), strict=True)):
        ref = store.put(f"s0-p{b // N}-{b % N}", routes, prompt_len=PROMPT_LEN, token_ids=tokens)
        samples.append((torch.as_tensor(tokens), ref))
    return samples


def nemo_batch(samples: list) -> dict:
    """The trainer's batch dict: right-padded input_ids, input_lengths, refs."""
    lengths = torch.tensor([len(t) for t, _ in samples])
    input_ids = torch.zeros((len(samples), int(lengths.max())), dtype=torch.long)
    for b, (tokens, _) in enumerate(samples):
        input_ids[b, : len(tokens)] = tokens
    refs = [r for _, r in samples]
    return {"input_ids": input_ids, "input_lengths": lengths, "routing_refs": refs}


def token_logprobs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Log-prob of each next token, [B, S-1], from a right-padded batch."""
    mask = torch.arange(batch["input_ids"].shape[1]) < batch["input_lengths"][:, None]
    logits = model(input_ids=batch["input_ids"], attention_mask=mask.long()).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    return logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def main() -> None:
    policy = tiny_moe(seed=0)  # float32 trainer
    engine = tiny_moe(seed=0, dtype=torch.bfloat16)  # same weights, bf16 "engine"
    layout = RoutingLayout.from_hf_config(policy.config)
    prompts = torch.randint(3, 128, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    name = f"nemo-example-{uuid.uuid4().hex[:8]}"
    with RoutingStore.create(name, layout, capacity_tokens=4096, page_tokens=4) as store:
        samples = rollout(store, engine, prompts)
        stats = store.stats()
        print(f"store: {stats.bytes_used} B used, {stats.bytes_unshared} B without sharing")

        whole = []

        def fetch_whole(refs):
            whole.append(store.read(refs))
            return whole[-1]

        batch = attach_routes(nemo_batch(samples), fetch=fetch_whole)
        batch_bytes = whole[0].nbytes
        routes = batch["routed_experts"]
        with capture(policy) as native, torch.no_grad():
            token_logprobs(policy, batch)
        recorded = [routes[b, :n].numpy() for b, n in enumerate(batch["input_lengths"])]
        before = routing_agreement(recorded, native.routes(), layout)
        print(f"agreement without replay: {before.router_agreement:.4f} of router decisions")

        # GRPO-style update: advantages from a toy reward, ratio to the old log-probs.
        optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
        reward = (batch["input_ids"] % 2 == 0).float().sum(1).view(-1, N)
        centred = reward - reward.mean(1, keepdim=True)
        advantage = (centred / (reward.std(1, keepdim=True) + 1e-6)).view(-1)
        target = torch.arange(1, routes.shape[1])  # position of each predicted token
        loss_mask = (target >= PROMPT_LEN) & (target < batch["input_lengths"][:, None])
        loss_mask = loss_mask.float()  # completion tokens only
        with replay(policy, routes):  # the old-logprob pass and the update, both replayed
            with torch.no_grad():
                old = token_logprobs(policy, batch)
            with capture(policy) as used:
                new = token_logprobs(policy, batch)
            ratio = torch.exp(new - old)
            loss = -(ratio * advantage[:, None] * loss_mask).sum() / loss_mask.sum()
            loss.backward()
        optimizer.step()
        after = routing_agreement(recorded, used.routes(), layout)
        router_grad = policy.model.layers[0].mlp.gate.weight.grad.abs().sum().item()
        print(f"agreement with replay: {after.router_agreement:.4f}; loss {loss.item():.4f}; "
              f"router grad |sum| {router_grad:.4f}")  # fmt: skip
        assert after.router_agreement == 1.0 and router_grad > 0

        # What rank (cp=1, tp=0) of a CP=2 x TP=2 sequence-parallel Megatron job receives.
        packed = pack(batch, multiple=2 * 2 * 2)
        ids = input_ids_for_rank(packed, cp_size=2, cp_rank=1)
        local = routes_for_rank(
            packed, cp_size=2, cp_rank=1, tp_size=2, tp_rank=0, sequence_parallel=True
        )
        print(f"packed {tuple(packed['input_ids'].shape)} -> CP rank 1 ids {tuple(ids.shape)}, "
              f"CP1/TP0 routes {tuple(local.shape)}")  # fmt: skip
        # The same rank reading only its tokens' ranges, not whole samples.
        read = []

        def fetch(refs, ranges):
            read.append(store.read(refs, ranges=ranges))
            return read[-1]

        own = read_rank_routes(
            nemo_batch(samples), cp_size=2, cp_rank=1, tp_size=2, tp_rank=0,
            sequence_parallel=True, pack_multiple=2 * 2 * 2, fetch=fetch,
        )  # fmt: skip
        assert torch.equal(own, local)
        print(f"CP1/TP0 read {read[0].nbytes} B of its ranges, equal to the slices of the "
              f"{batch_bytes} B whole-sample read")  # fmt: skip
        store.release([r for _, r in samples])


if __name__ == "__main__":
    main()
