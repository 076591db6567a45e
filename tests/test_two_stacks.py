"""DiffusionGemma: two stacks that route different tokens, each replayed and captured alone.

Its encoder routes the prompt (input_ids), its decoder the canvas it denoises
(decoder_input_ids, another length), once per denoising step: no token goes through both,
so the whole model is refused by name and each stack is a model of its own to replay and
capture, with routes of its own tokens. Checked where the experts are called.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from compiling import Graphs, reset_dynamo
from tiny_families import random_routes, tiny_config

from routing_replay import MISSING, RoutingLayout, capture, replay
from routing_replay.errors import UnsupportedModelError

B, S, C = 2, 6, 5  # batch, prompt tokens, canvas tokens


def tiny_diffusion_gemma(canvas: int = C):
    config = transformers.DiffusionGemmaConfig(
        text_config=tiny_config("diffusion_gemma_text"),
        vision_config=tiny_config("gemma4_vision"),  # (its default tower: 166M parameters)
        canvas_length=canvas,
    )
    torch.manual_seed(0)
    model = transformers.DiffusionGemmaForBlockDiffusion(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # spread routers and scales: no ties, a dropped scale shows
        for name, param in model.named_parameters():
            if name.endswith("router.proj.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif name.endswith("per_expert_scale"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    return model.eval()


def stacks(model):
    return model.model.encoder, model.model.decoder


def tokens(seed: int, width: int) -> torch.Tensor:
    return torch.randint(3, 200, (B, width), generator=torch.Generator().manual_seed(seed))


class Spy:
    """Per stack and MoE layer, the (ids, weights) its experts are called with, and the
    router's own output of each call."""

    def __init__(self, model) -> None:
        self.calls: dict[tuple[int, int], list] = {}
        self.router: dict[tuple[int, int], list] = {}
        self.handles = []
        for s, stack in enumerate(stacks(model)):
            for name, module in stack.named_modules():
                if type(module).__name__ == "DiffusionGemmaTextExperts":
                    j = int(name.split("layers.")[1].split(".")[0])
                    self.calls[s, j], self.router[s, j] = [], []
                    self.handles.append(module.register_forward_pre_hook(self._experts(s, j)))
                if type(module).__name__ == "DiffusionGemmaTextRouter":
                    j = int(name.split("layers.")[1].split(".")[0])
                    self.handles.append(module.register_forward_hook(self._router(s, j)))

    def _experts(self, s, j):
        def hook(module, args):
            self.calls[s, j].append((args[1].detach().clone(), args[2].detach().clone()))

        return hook

    def _router(self, s, j):
        def hook(module, args, out):
            self.router[s, j].append(args[0].detach())

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def gemma_weights(router, hidden_TH, ids_TK):
    """DiffusionGemma's router formula, written out: the softmax of its scaled, normed
    projection at the ids, over their sum, times each chosen expert's learned scale."""
    with torch.no_grad():
        h = router.norm(hidden_TH) * router.scale * router.hidden_size**-0.5
        probs_TE = torch.softmax(router.proj(h).float(), dim=-1)
        w_TK = probs_TE.gather(1, ids_TK)
        return w_TK / w_TK.sum(dim=-1, keepdim=True) * router.per_expert_scale[ids_TK]


def test_the_whole_model_is_refused_naming_each_stack():
    model = tiny_diffusion_gemma()
    for entry in (replay, lambda m, r: capture(m)):
        with pytest.raises(UnsupportedModelError) as err:
            entry(model, torch.zeros(B, S, 3, 2, dtype=torch.int32))
        assert "routes two sets of tokens, one per stack (model.encoder, model.decoder)" in str(
            err.value
        )
        assert "replay(model.model.encoder, " in str(err.value)
        assert "replay(model.model.decoder, " in str(err.value)


def test_each_stack_gets_its_own_forced_ids_and_the_formulas_weights_at_its_experts():
    model = tiny_diffusion_gemma()
    layout = RoutingLayout.from_hf_config(model.config)
    encoder, decoder = stacks(model)
    routes = [random_routes(layout, seed=3, missing=0.3, batch=B, seq=S)]
    routes.append(random_routes(layout, seed=4, missing=0.3, batch=B, seq=C))
    spy = Spy(model)
    try:
        with (
            replay(encoder, routes[0], layout=layout),
            replay(decoder, routes[1], layout=layout),
            torch.no_grad(),
        ):
            model(input_ids=tokens(1, S), decoder_input_ids=tokens(2, C))
    finally:
        spy.remove()
    missing, forced = [0, 0], [0, 0]
    for (s, j), ((ids, weights),) in spy.calls.items():
        forced_TK = routes[s].reshape(-1, layout.num_moe_layers, layout.top_k)[:, j].long()
        missing_T = (forced_TK == MISSING).all(-1)
        assert len(forced_TK) == B * (S, C)[s]  # the stack's own tokens
        missing[s] += int(missing_T.sum())
        forced[s] += int((~missing_T).sum())
        assert torch.equal(ids[~missing_T], forced_TK[~missing_T])
        router = dict(stacks(model)[s].named_modules())[
            ("language_model." if s == 0 else "") + f"layers.{j}.router"
        ]
        (hidden,) = spy.router[s, j]
        want = gemma_weights(router, hidden, ids)
        assert torch.equal(weights, want.to(weights.dtype))
        with torch.no_grad():  # missing rows: the router's own choice, bit for bit
            native = type(router).forward(router, hidden)
        assert torch.equal(ids[missing_T], native[2][missing_T])
        assert torch.equal(weights[missing_T], native[1][missing_T])
    assert all(missing) and all(forced)  # each stack had rows of both kinds


def test_each_stacks_own_choice_replayed_gives_the_native_logits_bitwise():
    model = tiny_diffusion_gemma()
    layout = RoutingLayout.from_hf_config(model.config)
    encoder, decoder = stacks(model)
    kwargs = {"input_ids": tokens(1, S), "decoder_input_ids": tokens(2, C)}
    with capture(encoder) as cap_e, capture(decoder) as cap_d, torch.no_grad():
        native = model(**kwargs).logits
    got_e, got_d = cap_e.routes(), cap_d.routes()
    assert [r.shape for r in got_e] == [(S, 3, 2)] * B  # per sample, its prompt
    assert [r.shape for r in got_d] == [(C, 3, 2)] * B  # and its canvas
    assert [t.tolist() for t in cap_d.token_ids()] == kwargs["decoder_input_ids"].tolist()
    own = [torch.from_numpy(np.stack(r)) for r in (got_e, got_d)]
    with (
        replay(encoder, own[0], layout=layout),
        replay(decoder, own[1], layout=layout),
        torch.no_grad(),
    ):
        again = model(**kwargs).logits
    assert torch.equal(again, native)
    other = random_routes(layout, seed=5, missing=0.0, batch=B, seq=C)
    with (
        replay(encoder, own[0], layout=layout),
        replay(decoder, other, layout=layout),
        torch.no_grad(),
    ):
        assert not torch.equal(model(**kwargs).logits, native)


@pytest.mark.slow
def test_router_gradients_checkpointing_and_compile_see_each_stacks_ids():
    model = tiny_diffusion_gemma().train()
    layout = RoutingLayout.from_hf_config(model.config)
    encoder, decoder = stacks(model)
    routes = [random_routes(layout, seed=6, missing=0.25, batch=B, seq=S)]
    routes.append(random_routes(layout, seed=7, missing=0.25, batch=B, seq=C))
    kwargs = {"input_ids": tokens(1, S), "decoder_input_ids": tokens(2, C)}

    def run(fn):
        model.zero_grad()
        spy = Spy(model)
        try:
            with (
                replay(encoder, routes[0], layout=layout),
                replay(decoder, routes[1], layout=layout),
            ):
                loss = fn(**kwargs).logits.float().square().mean()
                loss.backward()
        finally:
            spy.remove()
        return loss.detach(), spy

    eager, _ = run(model)
    for name, param in model.named_parameters():
        if name.endswith("router.proj.weight"):
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    model.gradient_checkpointing_enable()
    try:
        ckpt, spy_ckpt = run(model)
    finally:
        model.gradient_checkpointing_disable()
    reset_dynamo()
    graphs = Graphs()
    compiled, spy_c = run(torch.compile(model, backend=graphs))
    assert graphs.count > 0
    assert torch.equal(eager, ckpt)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    recomputed = {0: 1, 1: 2}  # the decoder's layers are checkpointed: forward, recompute
    for spy, calls in ((spy_ckpt, recomputed), (spy_c, {0: 1, 1: 1})):
        for (s, j), got in spy.calls.items():
            forced_TK = routes[s].reshape(-1, layout.num_moe_layers, layout.top_k)[:, j].long()
            forced_T = (forced_TK != MISSING).all(-1)
            assert len(got) == calls[s]
            for ids, _ in got:
                assert torch.equal(ids[forced_T], forced_TK[forced_T])


@pytest.mark.slow
def test_capture_while_generating_gives_each_denoising_step_its_own_sample():
    # Each step forwards the whole canvas again at the same positions (after what the cache
    # holds): a sample per step and prompt, never the steps run together as one sequence.
    model = tiny_diffusion_gemma(canvas=4)
    encoder, decoder = stacks(model)
    canvases = []
    hook = decoder.register_forward_pre_hook(
        lambda m, a, kw: canvases.append(kw["decoder_input_ids"].clone()), with_kwargs=True
    )
    spy = Spy(model)
    try:
        with capture(encoder) as cap_e, capture(decoder) as cap_d, torch.no_grad():
            out = model.generate(input_ids=tokens(1, S), max_new_tokens=8, max_denoising_steps=2)
    finally:
        hook.remove()
        spy.remove()
    steps = len(canvases)
    assert steps >= 2
    # The encoder forwards the prompt, then each committed block but the last (two blocks
    # of 4 here): one sample per prompt, its tokens the output's first S + 4.
    assert [r.shape for r in cap_e.routes()] == [(S + 4, 3, 2)] * B
    assert [t.tolist() for t in cap_e.token_ids()] == out.sequences[:, : S + 4].tolist()
    assert [r.shape for r in cap_d.routes()] == [(4, 3, 2)] * (B * steps)
    want_tokens = [c[b].tolist() for c in canvases for b in range(B)]
    assert [t.tolist() for t in cap_d.token_ids()] == want_tokens
    for j in range(3):  # step i, sample b: what layer j's experts got in that step
        want = [ids.reshape(B, 4, 2)[b] for ids, _ in spy.calls[1, j] for b in range(B)]
        got = [torch.from_numpy(r[:, j]).long() for r in cap_d.routes()]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
