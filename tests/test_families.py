"""Replay at the experts for every router family of transformers 5.25 beyond `moe_models.py`'s.

Each family is a tiny model built from its own config class (`tiny_families.py`):
- its own choice replayed gives back its native logits bit for bit: the score function is
  the router's own formula (the oracle is transformers' forward, not ours);
- forced ids reach the experts module on every forced row, with the score function's
  weights in the router's dtype, and missing rows (-1) get the router's own ids and weights;
- the router's weight gets a gradient through the forced weights;
- under gradient checkpointing and torch.compile the experts see the same forced ids.
"""

from __future__ import annotations

import queue
import traceback

import numpy as np
import pytest
import torch
from compiling import Graphs, reset_dynamo
from lean_workers import LEAN, in_lean_workers
from tiny_families import random_routes, router_weight, tiny_family_model

from routing_replay import capture, replay
from routing_replay.model import outputs
from routing_replay.model.adapters import find_routers
from routing_replay.validate import MISSING

TOP_K = 2  # tiny_families' top-k

B, S = 2, 8
# model type -> its router class (all token-choice top-k, forward -> (logits, weights, ids)).
FAMILIES = {
    "afmoe": "AfmoeTokenChoiceRouter",
    "aria_text": "AriaTextTopKRouter",
    "axk1": "AXK1TopkRouter",
    "axk2": "AXK2TopkRouter",
    "bailing_hybrid": "BailingHybridTopkRouter",
    "beam": "BeamTopKRouter",
    "deepseek_ocr2_text": "DeepseekOcr2TextTopkRouter",
    "dots3_note_text": "Dots3NoteTextTopkRouter",
    "ergo": "ErgoTopkRouter",
    "ernie4_5_vl_moe_text": "Ernie4_5_VLMoeMoeTopKRouter",
    "flint": "FlintTopKRouter",
    "gemma4_text": "Gemma4TextRouter",
    "glm4v_moe_text": "Glm4vMoeTextTopkRouter",
    "glm5_next_text": "Glm5NextTextTopkRouter",
    "glm_moe_dsa": "GlmMoeDsaTopkRouter",
    "granitemoe_swa": "GraniteMoeSWATopKRouter",
    "granitemoehybrid": "GraniteMoeHybridTopKRouter",
    "granitemoeshared": "GraniteMoeSharedTopKRouter",
    "hy_v3": "HYV3TopKRouter",
    "hy_v4": "HYV4TopkRouter",
    "hy_v4_vl_text": "HYV4VLTopkRouter",
    "inkling_text": "InklingTopkRouter",
    "jetmoe": "JetMoeTopKGating",
    "inkling2_text": "Inkling2TopKRouter",
    "inkling2_loop_text": "Inkling2LoopTopKRouter",
    "kolibri1": "Kolibri1TopKRouter",
    "kolibri1_1": "Kolibri1_1TopKRouter",
    "laguna": "LagunaTopKRouter",
    "lara_mini": "LaraMiniTopKRouter",
    "longcat_flash": "LongcatFlashTopkRouter",
    "mellum": "MellumTopKRouter",
    "mimo_v2_flash": "MiMoV2FlashTopkRouter",
    "minicpm5_moe": "MiniCPM5MoeTopkRouter",
    "minimax_m3_vl_text": "MiniMaxM3VLTopKRouter",
    "mistral4": "Mistral4TopkRouter",
    "mistral_large4_text": "MistralLarge4TextTopkRouter",
    "muse_spark_text": "MuseSparkTopkRouter",
    "nemotron_h": "NemotronHTopkRouter",
    "openai_privacy_filter": "OpenAIPrivacyFilterTopKRouter",
    "phimoe": "PhimoeTopKRouter",
    "llama4_text": "Llama4Router",
    "dbrx": "DbrxFFN",
    "doge": "DogeCDMoE",
    "qwen3_omni_moe_text": "Qwen3OmniMoeThinkerTextTopKRouter",
    "qwen3_omni_moe_talker_text": "Qwen3OmniMoeTalkerTextTopKRouter",
    "qwen3_vl_moe_text": "Qwen3VLMoeTextTopKRouter",
    "qwen4_exp_text": "Qwen4ExpTextTopKRouter",
    "solar_open": "SolarOpenTopkRouter",
    "step3p5": "Step3p7TopKRouter",
    "unlimited_ocr_text": "UnlimitedOcrTextTopkRouter",
    "zaya": "ZayaRouter",
}
# The fast tier: a few families of the new score functions and output forms; all in the slow.
FAST = {
    "doge",
    "ergo",
    "gemma4_text",
    "inkling_text",
    "jetmoe",
    "llama4_text",
    "mistral4",
    "phimoe",
    "zaya",
}
# Checkpointing and compile with AOT autograd (slow): one family of each score function or
# output form new here; every other family under Dynamo alone.
COMPILED = FAST | {"openai_privacy_filter", "beam", "afmoe", "kolibri1", "dbrx", "longcat_flash"}
# Looped layers (each pass its own layout layer) are checked under Dynamo alone: checkpointing
# and compile see every pass (AOT autograd on them took 29 s of the test's 2 x 120).
LONGEST = ("inkling2_loop_text", "jetmoe", "dbrx")  # queued first: the workers end together
PARAMS = [
    pytest.param(f, marks=() if f in FAST else pytest.mark.slow, id=f) for f in sorted(FAMILIES)
]
EMBEDS_ONLY = {"qwen3_omni_moe_talker_text"}  # no token embedding: called with embeddings
# Zero-computation experts (ids >= n_routed_experts): the block adds their share of the input
# itself, so their ids reach no experts module; checked where the block gets them.
ZERO_EXPERTS = {"longcat_flash"}
# A skip expert (id E, the layout's last): the router hands the experts id 0, weight 0, for it.
SKIP_EXPERT = {"zaya"}
# Shared experts' gammas normalised with the chosen experts' weights: forced ids change both.
SHARED_GAMMAS = {"inkling_text"}
# Product-key experts picked inline by the MoE block (Doge): no experts module, the ids reach
# its embedding lookups and its output is recomputed at them.
PRODUCT_KEYS = {"doge"}
# Compiled with its attention left eager: Doge's attention alone fails torch.compile's backward
# (a view of a gradient whose strides do not allow it; dense Doge too), its MoE block compiles.
EAGER_ATTENTION = {"doge"}
# Not run in bfloat16: transformers' own forward fails there.
NO_BFLOAT16 = {
    "inkling2_text": "its forward multiplies float32 by bfloat16 (transformers 5.25)",
    "inkling2_loop_text": "its forward multiplies float32 by bfloat16 (transformers 5.25)",
}
# No gradient checkpointing (its PreTrainedModel says so): compiled only.
NO_CHECKPOINTING = {"jetmoe"}


def inputs(model, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    if model.config.model_type in EMBEDS_ONLY:
        hidden = model.config.hidden_size
        return {"inputs_embeds": torch.randn(B, S, hidden, generator=gen)}
    return {"input_ids": torch.randint(3, 200, (B, S), generator=gen)}


def output(model, kwargs: dict) -> torch.Tensor:
    out = model(**kwargs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


class MethodSpy:
    """`hook(module, args, output)` after each call of a module's method; `remove()`."""

    def __init__(self, module, method: str, hook) -> None:
        self.module, self.method, self.own = module, method, vars(module).get(method)
        inner = getattr(module, method)

        def spied(*args, **kwargs):
            out = inner(*args, **kwargs)
            hook(module, args, out)
            return out

        setattr(module, method, spied)

    def remove(self) -> None:
        if self.own is None:
            del self.module.__dict__[self.method]
        else:
            setattr(self.module, self.method, self.own)


def _detached(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def unsorted(module, out) -> tuple[torch.Tensor, torch.Tensor]:
    """JetMoE's `(index_sorted_experts, batch_index, batch_gates, expert_size, logits)` as its
    experts use it, back to per-token `[T, K]` (ids, gates): expert e takes the next
    expert_size[e] sorted pairs; pair p is token batch_index[p], slot index_sorted[p] % K."""
    index_sorted, batch_index, gates, expert_size, logits = out[:5]
    k = module.top_k
    assert torch.equal(batch_index, index_sorted.div(k, rounding_mode="trunc"))
    experts = torch.repeat_interleave(torch.arange(len(expert_size)), torch.tensor(expert_size))
    ids = torch.empty_like(index_sorted)
    weights = torch.empty_like(gates)
    ids[index_sorted] = experts.to(ids.device)
    weights[index_sorted] = gates
    rows = logits.shape[0]
    return ids.view(rows, k).detach().clone(), weights.view(rows, k).detach().clone()


class ExpertsSpy:
    """The (ids, weights) each MoE layer's experts module is called with, and each router's
    output (as the MoE block gets it) and inputs (args, kwargs: Zaya's routers take the
    previous layer's router states by keyword)."""

    def __init__(self, model, recompute: bool = False) -> None:
        self.moe = find_routers(model)
        # Per router module, its MoE layers' indices in call order: one, or a looped layer's
        # passes in order (then, recomputed by checkpointing, in reverse order: backward).
        self.order: list[list[int]] = []
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.outs: list[list[torch.Tensor]] = []
        self.args: list[list[tuple]] = []
        self.gammas: list[list[torch.Tensor]] = []  # what Inkling's shared experts get
        # Doge's embedding lookups in its block's call so far: under replay, the native forward's
        # then the forced ids' (the block's output is recomputed); the last is what it returns.
        self.lookups: list[list[torch.Tensor]] = []
        self.handles = []
        for j, (router, layers) in enumerate(self.moe.by_module()):
            order = list(layers)
            self.order.append(order + order[::-1] if recompute and len(order) > 1 else order)
            parent = model.get_submodule(router.name.rsplit(".", 1)[0])
            if hasattr(router.module, "experts"):  # DBRX: the router is the MoE block itself
                parent = router.module
            self.calls.append([])
            self.outs.append([])
            self.args.append([])
            self.gammas.append([])
            self.lookups.append([])
            if isinstance(router.output, outputs.SharedGammas):
                self.handles.append(
                    parent.shared_experts.register_forward_pre_hook(
                        self._gammas(j), with_kwargs=True
                    )
                )
            if isinstance(router.output, outputs.ProductKeys):  # Doge: its embedding lookups
                self.handles.append(
                    router.module.down_embed.register_forward_pre_hook(self._lookups(j))
                )
            elif not isinstance(router.output, outputs.Sorted):  # JetMoE: no experts call
                self.handles.append(
                    parent.experts.register_forward_pre_hook(self._experts(j), with_kwargs=True)
                )
            if router.method == "forward":
                self.handles.append(
                    router.module.register_forward_hook(self._router(j), with_kwargs=True)
                )
            else:  # DBRX: the block's method that routes, wrapped (over replay's, if there)
                self.handles.append(MethodSpy(router.module, router.method, self._router(j)))

    def by_layer(self) -> None:
        """Regroup what each module saw by MoE layer (a looped layer's calls by pass)."""
        for name in ("calls", "outs", "args", "gammas"):
            per_module = getattr(self, name)
            per_layer = [[] for _ in range(self.moe.layout.num_moe_layers)]
            for order, seen in zip(self.order, per_module, strict=True):
                for k, item in enumerate(seen):
                    per_layer[order[k % len(order)]].append(item)
            setattr(self, name, per_layer)

    def _experts(self, j):
        def hook(module, args, kwargs):
            ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            weights = kwargs.get("top_k_weights", args[2] if len(args) > 2 else None)
            if ids is not None:  # None: Llama 4's experts take the scaled tokens only
                self.calls[j].append((ids.detach().clone(), weights.detach().clone()))

        return hook

    def _lookups(self, j):
        def hook(module, args):  # Doge's routed experts: (ids, no weights)
            self.lookups[j].append(args[0].detach().clone())

        return hook

    def _gammas(self, j):
        def hook(module, args, kwargs):
            self.gammas[j].append(kwargs["gammas"].detach().clone())

        return hook

    def _router(self, j):
        def hook(module, args, *rest):  # what the MoE block gets: forced, when replaying
            kwargs, out = rest if len(rest) == 2 else ({}, rest[0])
            if isinstance(self.moe.by_module()[j][0].output, outputs.Sorted):
                self.calls[j].append(unsorted(module, out))
                out = (out[4], None, None)  # what the block is scored from
            if self.lookups[j]:  # Doge: the ids behind the output the block returns
                self.calls[j].append((self.lookups[j][-1], None))
                self.lookups[j].clear()
            self.outs[j].append(tuple(_detached(o) for o in out[:3]))
            args = tuple(a.detach().clone() for a in args)
            self.args[j].append((args, {k: _detached(v) for k, v in kwargs.items()}))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.by_layer()


@pytest.fixture(scope="module", params=PARAMS)
def family(request):
    return request.param


def test_routers_are_found_at_the_layouts_moe_layers(family):
    model = tiny_family_model(family)
    moe = find_routers(model)
    assert {type(r.module).__name__ for r in moe.routers} == {FAMILIES[family]}
    assert [r.layer for r in moe.routers] == list(moe.layout.moe_layers)


def test_own_choice_replayed_gives_the_native_output(family):
    # Exactly, and with tolerance=1.0, which keeps a recorded expert the router scores at
    # least as high as its own weakest pick: the model's own choice is kept whole.
    model = tiny_family_model(family)
    kwargs = inputs(model, seed=1)
    with capture(model) as cap, torch.no_grad():
        native = output(model, kwargs)
    routes = torch.from_numpy(np.stack(cap.routes()))
    with replay(model, routes, layout=cap.layout), torch.no_grad():
        assert torch.equal(output(model, kwargs), native)
    with replay(model, routes, layout=cap.layout, tolerance=1.0) as block, torch.no_grad():
        assert torch.equal(output(model, kwargs), native)
    rows = int(np.prod(routes.shape[:-1]))  # every (token, MoE layer) row, none missing
    assert block.metrics() == {
        "replay/rows_replayed": rows,
        "replay/rows_missing": 0,
        "replay/native_agreement": 1.0,
        "replay/replace_rate": 0.0,
    }


def test_own_choice_replayed_in_bfloat16_gives_the_native_output(family):
    # Each router's own dtype steps: before, Ergo's forced weights skipped its rounding to
    # the input's dtype (up to 1.9e-3 off, and a different choice in later layers).
    if family in NO_BFLOAT16:
        pytest.skip(NO_BFLOAT16[family])
    model = tiny_family_model(family, dtype=torch.bfloat16)
    kwargs = inputs(model, seed=1)
    kwargs = {k: v.bfloat16() if v.is_floating_point() else v for k, v in kwargs.items()}
    with capture(model) as cap, torch.no_grad():
        native = output(model, kwargs)
    routes = torch.from_numpy(np.stack(cap.routes()))
    with replay(model, routes, layout=cap.layout) as block, torch.no_grad():
        assert torch.equal(output(model, kwargs), native)
    assert block.metrics()["replay/native_agreement"] == 1.0


def test_capture_inside_replay_records_what_the_experts_got(family):
    # Either nesting: the forced ids, and the router's own on missing rows. The oracle is
    # transformers' forward: replaying what was recorded, no row missing, gives the same
    # output bit for bit (before: Llama 4, JetMoE and Doge recorded their native choice,
    # Zaya expert 0 for a forced skip).
    model = tiny_family_model(family)
    layout = find_routers(model).layout
    kwargs = inputs(model, seed=4)
    routes = random_routes(layout, seed=5, missing=0.3)
    forced = ~(routes == MISSING).any(-1)
    for replay_outside in (True, False):
        with torch.no_grad():
            if replay_outside:
                with replay(model, routes, layout=layout), capture(model) as cap:
                    out = output(model, kwargs)
            else:
                with capture(model) as cap, replay(model, routes, layout=layout):
                    out = output(model, kwargs)
        got = torch.from_numpy(np.stack(cap.routes()))
        assert torch.equal(got[forced], routes[forced].to(got.dtype)), replay_outside
        assert (got != MISSING).all()
        with replay(model, got, layout=layout), torch.no_grad():
            assert torch.equal(output(model, kwargs), out), replay_outside


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama4_text", "qwen3_vl_moe_text", "zaya"])
def test_capture_inside_replay_of_a_compiled_model_records_the_forced_ids(family):
    # The model compiled and replayed first, then a capture block opened inside replay: the
    # forced ids recorded, as eager records them (before: Llama 4 and Zaya recorded their
    # native choice; Qwen3-VL's code compiled before the block skipped its hooks, and the
    # block raised that routers were never called).
    reset_dynamo()
    model = tiny_family_model(family)
    layout = find_routers(model).layout
    kwargs = inputs(model, seed=4)
    routes = random_routes(layout, seed=5, missing=0.0)
    graphs = Graphs("eager")
    compiled = torch.compile(model, backend=graphs)
    with torch.no_grad():
        with replay(model, routes, layout=layout):
            output(compiled, kwargs)
        with replay(model, routes, layout=layout), capture(model) as cap:
            output(compiled, kwargs)
    assert graphs.count > 0
    assert torch.equal(torch.from_numpy(np.stack(cap.routes())), routes.to(torch.int32))


def test_forced_ids_reach_the_experts(family):
    model = tiny_family_model(family)
    layout = find_routers(model).layout
    kwargs = inputs(model, seed=2)
    routes = random_routes(layout, seed=3, missing=0.3)
    spy = ExpertsSpy(model)
    try:
        with replay(model, routes, layout=layout), torch.no_grad():
            output(model, kwargs)
    finally:
        spy.remove()
    flat = routes.reshape(B * S, layout.num_moe_layers, layout.top_k)
    skips = 0
    for j, router in enumerate(spy.moe.routers):
        forced_TK = flat[:, j].long()
        missing_T = (forced_TK == MISSING).any(-1)
        assert 0 < int(missing_T.sum()) < B * S
        module, (out,) = router.module, spy.outs[j]
        args, kwargs = spy.args[j][0]
        with torch.no_grad():  # the router's own output, bypassing every hook
            native = getattr(type(module), router.method)(module, *args, **kwargs)
        if family in PRODUCT_KEYS:
            ((ids, _),) = spy.calls[j]
            check_product_keys(module, args[0], out, ids, forced_TK, missing_T)
            continue
        if isinstance(router.output, outputs.Scatter):  # Llama 4: the block scales by scores_TE
            scores_TE, logits_TE = out[:2]
            chosen_TE = torch.zeros_like(scores_TE, dtype=torch.bool)
            chosen_TE[~missing_T] = chosen_TE[~missing_T].scatter(1, forced_TK[~missing_T], True)
            expected = torch.sigmoid(logits_TE.gather(1, forced_TK.clamp(min=0)).float())
            assert torch.equal((scores_TE != 0)[~missing_T], chosen_TE[~missing_T])
            got = scores_TE.gather(1, forced_TK.clamp(min=0))
            assert torch.equal(got[~missing_T], expected.to(got.dtype)[~missing_T])
            assert torch.equal(scores_TE[missing_T], native[0][missing_T])
            continue
        if family in ZERO_EXPERTS:
            ids, weights = out[2], out[1]
        else:
            ((ids, weights),) = spy.calls[j]
        pair = isinstance(router.output, outputs.Pair)  # DBRX: scored from the call's logits
        scores_TE = args[0] if pair else out[0]
        if family in SHARED_GAMMAS:  # the router's own forward, made to pick the forced ids
            expected, gammas = forced_by_the_router(module, args, forced_TK)
            assert torch.equal(ids[~missing_T], forced_TK[~missing_T])
            (got_gammas,) = spy.gammas[j]
            assert torch.equal(got_gammas[~missing_T], gammas[~missing_T])
            assert torch.equal(got_gammas[missing_T], native[3][missing_T])
            assert not torch.equal(gammas[~missing_T], native[3][~missing_T])
        elif family in SKIP_EXPERT:  # a forced skip reaches the experts as id 0, weight 0
            skip_TK = forced_TK == layout.num_experts - 1
            skips += int(skip_TK[~missing_T].sum())
            assert torch.equal(ids[~missing_T], forced_TK.masked_fill(skip_TK, 0)[~missing_T])
            expected = torch.softmax(scores_TE, dim=-1).gather(1, forced_TK.clamp(min=0))
            expected = expected.masked_fill(skip_TK, 0)
        else:
            assert torch.equal(ids[~missing_T], forced_TK[~missing_T])
            expected = router.score(module, scores_TE, ids).to(weights.dtype)
        assert torch.equal(weights[~missing_T], expected[~missing_T])
        native_w, native_ids = native[:2] if pair else native[1:3]
        if isinstance(router.output, outputs.Sorted):
            native_ids, native_w = unsorted(module, native)
        assert weights.dtype == native_w.dtype
        assert torch.equal(ids[missing_T], native_ids[missing_T])
        assert torch.equal(weights[missing_T], native_w[missing_T])
    assert skips > 0 or family not in SKIP_EXPERT


def product_keys_native(module, hidden_BSH):
    """Doge's MoE block's own forward (no hook of ours) and the ids it looked up."""
    seen = []
    handle = module.down_embed.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            out = type(module).forward(module, hidden_BSH)
    finally:
        handle.remove()
    (ids_NK,) = seen
    return out, ids_NK


def product_keys_experts(module, hidden_BSH, logits_2NK, ids_NK):
    """Doge's routed experts' sum at `ids_NK`, written out in float64: expert e's score is
    x[e // num_keys] + y[e % num_keys] (the logits' two halves), the weights their softmax
    over the chosen (over their sum by `norm_topk_prob`), each expert's output
    act(down_embed[e] . h) * weight * up_embed[e]."""
    keys = module.num_keys
    x_NK, y_NK = logits_2NK.double()
    scores_NK = x_NK.gather(1, ids_NK // keys) + y_NK.gather(1, ids_NK % keys)
    weights_NK = torch.softmax(scores_NK, dim=-1)
    if module.norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    hidden_NH = hidden_BSH.reshape(ids_NK.shape[0], -1).double()
    down_NKH = module.down_embed.weight.double()[ids_NK]
    up_NKH = module.up_embed.weight.double()[ids_NK]
    act_NK = module.act_fn(torch.einsum("nkh,nh->nk", down_NKH, hidden_NH)) * weights_NK
    return torch.einsum("nk,nkh->nh", act_NK, up_NKH)


def check_product_keys(module, hidden_BSH, out, ids_NK, forced_TK, missing_T):
    """Doge: the forced ids are what its embeddings look up, and the block's output is its
    shared expert plus the routed experts at them (`product_keys_experts`); missing rows get
    the block's own ids and output, bit for bit."""
    got_BSH, logits_2NK = out
    native, native_ids = product_keys_native(module, hidden_BSH)
    assert torch.equal(logits_2NK, native[1])
    assert torch.equal(ids_NK[~missing_T], forced_TK[~missing_T])
    assert torch.equal(ids_NK[missing_T], native_ids[missing_T])
    with torch.no_grad():
        shared_BSH = module.down_proj(
            module.act_fn(module.gate_proj(hidden_BSH)) * module.up_proj(hidden_BSH)
        )
    routed_NH = (got_BSH - shared_BSH).reshape(ids_NK.shape[0], -1)
    want_NH = product_keys_experts(module, hidden_BSH, logits_2NK, forced_TK.clamp(min=0))
    assert routed_NH[~missing_T].abs().max() > 1e-3  # the routed experts add something
    torch.testing.assert_close(
        routed_NH[~missing_T], want_NH[~missing_T].float(), rtol=1e-4, atol=1e-6
    )
    got_NH, native_NH = got_BSH.flatten(0, 1), native[0].flatten(0, 1)
    assert torch.equal(got_NH[missing_T], native_NH[missing_T])
    assert not torch.equal(got_NH[~missing_T], native_NH[~missing_T])


def test_doge_capture_records_the_ids_its_block_looked_up():
    """Doge picks its experts inside its MoE block (no router module): capture records the ids
    its embeddings looked up, and those replayed give the native output bit for bit."""
    model = tiny_family_model("doge")
    spy = ExpertsSpy(model)
    try:
        with capture(model) as cap, torch.no_grad():
            native = output(model, inputs(model, seed=1))
    finally:
        spy.remove()
    routes = torch.from_numpy(np.stack(cap.routes()))
    looked_up = torch.stack([ids for ((ids, _),) in spy.calls], dim=1)
    assert torch.equal(routes.long(), looked_up.reshape(routes.shape))
    assert len(torch.unique(looked_up)) > 8  # spread over the 16 experts
    with replay(model, routes, layout=cap.layout), torch.no_grad():
        assert torch.equal(output(model, inputs(model, seed=1)), native)


def forced_by_the_router(module, args, forced_TK):
    """Inkling: (weights, gammas) its router's own forward gives at `forced_TK`, row by row: a
    correction bias (which only chooses) of 100 at a row's forced experts makes it pick them.
    Weights in the forced ids' order; missing rows (-1) are left 0."""
    bias = module.e_score_correction_bias
    saved = bias.clone()
    weights = torch.zeros(forced_TK.shape)
    gammas = torch.zeros(forced_TK.shape[0], module.n_shared_experts)
    try:
        with torch.no_grad():
            for t, ids_K in enumerate(forced_TK):
                if (ids_K < 0).any():
                    continue
                bias.zero_()
                bias[ids_K] = 100.0
                _, w_TK, i_TK, g_TS = type(module).forward(module, *args)
                slot_K = (i_TK[t][None, :] == ids_K[:, None]).int().argmax(dim=1)
                assert torch.equal(i_TK[t][slot_K], ids_K)
                weights[t], gammas[t] = w_TK[t][slot_K], g_TS[t]
    finally:
        with torch.no_grad():
            bias.copy_(saved)
    return weights, gammas


def test_zaya_capture_records_the_skip_expert_the_router_rewrites():
    """Zaya's router picks among E experts and a skip (id E), then hands the experts id 0 with
    weight 0 for a skip: capture records E there, not 0 (expert 0 is also picked for real)."""
    model = tiny_family_model("zaya")
    kwargs = inputs(model, seed=1)
    skip = model.config.num_experts
    raw = []  # each router's choice before the rewrite, from its own forward

    def unmasked(module, args, kwargs, out):
        config = module.config
        module.config = type(config)(**{**config.to_dict(), "num_experts": -1})  # masks nothing
        try:
            with torch.no_grad():
                raw.append(type(module).forward(module, *args, **kwargs)[2])
        finally:
            module.config = config

    moe = find_routers(model)
    handles = [r.module.register_forward_hook(unmasked, with_kwargs=True) for r in moe.routers]
    try:
        with capture(model) as cap, torch.no_grad():
            native = output(model, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    assert cap.layout.num_experts == skip + 1
    routes = torch.from_numpy(np.stack(cap.routes()))
    want = torch.stack(raw, dim=1).reshape(routes.shape)
    assert torch.equal(routes.long(), want)
    assert (want == skip).any() and (want == 0).any()
    with replay(model, routes, layout=cap.layout), torch.no_grad():
        assert torch.equal(output(model, kwargs), native)


# ERNIE 4.5 VL: each MoE layer has a text router and a vision router; its block routes the
# tokens of type 0 by the first, the others (image, video) by the second.
ERNIE = "ernie4_5_vl_moe_text"


def ernie_types() -> torch.Tensor:
    """`moe_mm_token_type_ids` of a batch with image tokens (1) and video tokens (2)."""
    types = torch.zeros(B, S, dtype=torch.long)
    types[0, 2:6] = 1
    types[1, 5:] = 2
    return types


def ernie_spy(model):
    """Per MoE layer and part (0: text, 1: vision): the (ids, weights) its experts get, and the
    router's args. Returns (calls, args, handles)."""
    moe = find_routers(model)
    calls, args, handles = {}, {}, []
    for router in moe.all_routers:
        key = (moe.slot(router), router.rows.part)
        calls[key], args[key] = [], []
        block = model.get_submodule(router.name.rsplit(".", 1)[0])

        def experts(module, a, kwargs, key=key):
            calls[key].append((a[1].detach().clone(), a[2].detach().clone()))

        def gate(module, a, out, key=key):
            args[key].append(a[0].detach().clone())

        handles.append(block.experts.register_forward_pre_hook(experts, with_kwargs=True))
        handles.append(router.module.register_forward_hook(gate))
    return calls, args, handles


@pytest.mark.slow
def test_ernie_vl_routes_each_token_by_its_types_router():
    """Image and video tokens in the batch: capture records each token's route from the router
    that routed it, the recorded routes replayed give the native output bit for bit, and forced
    ids reach each router's experts on its own tokens (missing rows: that router's own)."""
    model = tiny_family_model(ERNIE)
    moe = find_routers(model)
    assert [r.rows.part for r in moe.routers] == [0, 0] and len(moe.extra) == 2
    types = ernie_types()
    vision_N = types.reshape(-1) != 0
    kwargs = {**inputs(model, seed=1), "moe_mm_token_type_ids": types}
    calls, args, handles = ernie_spy(model)
    try:
        with capture(model) as cap, torch.no_grad():
            native = output(model, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    routes = torch.from_numpy(np.stack(cap.routes()))
    flat = routes.reshape(B * S, 2, TOP_K).long()
    for j in range(2):  # each part's rows hold its own router's choice
        for part, rows_N in ((0, ~vision_N), (1, vision_N)):
            ((ids, _),) = calls[j, part]
            assert torch.equal(flat[rows_N, j], ids)
    with replay(model, routes, layout=cap.layout), torch.no_grad():
        assert torch.equal(output(model, kwargs), native)

    forced = random_routes(moe.layout, seed=3, missing=0.3)
    calls, args, handles = ernie_spy(model)
    try:
        with replay(model, forced, layout=moe.layout), torch.no_grad():
            replayed = output(model, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    assert not torch.equal(replayed, native)
    flat = forced.reshape(B * S, 2, TOP_K).long()
    for router in moe.all_routers:
        j, part = moe.slot(router), router.rows.part
        rows_N = vision_N if part else ~vision_N
        forced_TK = flat[rows_N, j]
        missing_T = (forced_TK == MISSING).any(-1)
        assert 0 < int(missing_T.sum()) < len(missing_T)
        ((ids, weights),) = calls[j, part]
        (hidden,) = args[j, part]
        with torch.no_grad():
            logits, native_w, native_ids = type(router.module).forward(router.module, hidden)
        expected = router.score(router.module, logits, forced_TK.clamp(min=0))
        assert torch.equal(ids[~missing_T], forced_TK[~missing_T])
        assert torch.equal(weights[~missing_T], expected[~missing_T])
        assert torch.equal(ids[missing_T], native_ids[missing_T])
        assert torch.equal(weights[missing_T], native_w[missing_T])


@pytest.mark.slow
def test_ernie_vl_both_routers_get_gradients_and_checkpointing_and_compile_see_the_ids():
    model = tiny_family_model(ERNIE).train()
    moe = find_routers(model)
    kwargs = {**inputs(model, seed=6), "moe_mm_token_type_ids": ernie_types()}
    vision_N = kwargs["moe_mm_token_type_ids"].reshape(-1) != 0
    routes = random_routes(moe.layout, seed=7, missing=0.25)
    flat = routes.reshape(B * S, 2, TOP_K).long()

    def run(fn):
        model.zero_grad()
        calls, _, handles = ernie_spy(model)
        try:
            with replay(model, routes, layout=moe.layout):
                loss = fn(**kwargs).float().square().mean()
                loss.backward()
        finally:
            for handle in handles:
                handle.remove()
        return loss.detach(), calls

    eager, _ = run(lambda **kw: output(model, kw))
    for router in moe.all_routers:
        assert router.module.weight.grad.abs().sum() > 0, router.name
    model.gradient_checkpointing_enable()
    try:
        ckpt, calls_ckpt = run(lambda **kw: output(model, kw))
    finally:
        model.gradient_checkpointing_disable()
    reset_dynamo()
    graphs = Graphs()
    compiled, calls_c = run(torch.compile(lambda **kw: output(model, kw), backend=graphs))
    assert graphs.count > 0
    assert torch.equal(eager, ckpt)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for calls, count in ((calls_ckpt, 2), (calls_c, 1)):  # checkpointed: forward, recompute
        for (j, part), got in calls.items():
            forced_TK = flat[vision_N if part else ~vision_N, j]
            forced_T = (forced_TK != MISSING).all(-1)
            assert len(got) == count
            for ids, _ in got:
                assert torch.equal(ids[forced_T], forced_TK[forced_T])


def test_router_weights_get_gradients(family):
    model = tiny_family_model(family).train()
    layout = find_routers(model).layout
    routes = random_routes(layout, seed=4, missing=0.0)
    with replay(model, routes, layout=layout):
        output(model, inputs(model, seed=5)).float().square().mean().backward()
    for router in find_routers(model).routers:
        weight = router_weight(router.module)
        assert weight.grad is not None and weight.grad.abs().sum() > 0, router.name
        if family in SHARED_GAMMAS:  # the shared experts' rows, through the forced gammas
            assert weight.grad[router.module.num_experts :].abs().sum() > 0, router.name


def chosen(spy: ExpertsSpy, j: int, family: str) -> list[torch.Tensor]:
    """Per call of layer j's MoE block, the experts each token went to, sorted."""
    if isinstance(spy.moe.routers[j].output, outputs.Scatter):  # the nonzero scores
        k = spy.moe.layout.top_k
        return [out[0].topk(k, dim=1).indices.sort(dim=1).values for out in spy.outs[j]]
    if family in ZERO_EXPERTS:  # as the block gets them: zero experts reach no experts module
        return [out[2].sort(dim=1).values for out in spy.outs[j]]
    return [ids.sort(dim=1).values for ids, _ in spy.calls[j]]


@pytest.mark.slow
def test_every_family_under_checkpointing_and_compile_sees_the_forced_ids():
    # AOT autograd (aot_eager) on one family of each form, Dynamo alone (its graph breaks,
    # our forcing in its graphs) on every other: in two lean workers, both cores.
    todo = LEAN.Queue()  # each worker takes the next family as it finishes one
    for family in sorted(FAMILIES, key=lambda f: (f not in LONGEST, f)):
        todo.put((family, "aot_eager" if family in COMPILED else "eager"))
    parts = in_lean_workers(checked, [(todo,), (todo,)])
    assert sorted(f for part in parts for f in part) == sorted(FAMILIES)
    failed = {f: tb for part in parts for f, tb in part.items() if tb}
    assert not failed, "\n".join(f"{f}:\n{tb}" for f, tb in failed.items())


def checked(todo) -> dict[str, str]:
    """`check_checkpointing_and_compile` of each (family, backend) taken from `todo` until it
    is empty: per family checked, its traceback if it failed, else ""."""
    torch.set_num_threads(1)  # one core per worker
    done = {}
    while True:
        try:
            family, backend = todo.get(timeout=1)
        except queue.Empty:
            return done
        try:
            check_checkpointing_and_compile(family, backend)
            done[family] = ""
        except Exception:
            done[family] = traceback.format_exc()


def check_checkpointing_and_compile(family: str, backend: str) -> None:
    """Under gradient checkpointing (forward and recompute) and compiled with `backend`, the
    experts see the forced ids; the loss is eager's."""
    model = tiny_family_model(family).train()
    layout = find_routers(model).layout
    kwargs = inputs(model, seed=6)
    routes = random_routes(layout, seed=7, missing=0.25)
    flat = routes.reshape(B * S, layout.num_moe_layers, layout.top_k).long()
    forced_L = [(flat[:, j] != MISSING).all(-1) for j in range(layout.num_moe_layers)]
    if family in SKIP_EXPERT:  # the experts get id 0 for a skip
        flat = flat.masked_fill(flat == layout.num_experts - 1, 0)
    want_L = [flat[:, j].sort(dim=1).values for j in range(layout.num_moe_layers)]

    def run(fn, recompute=False):
        torch.manual_seed(8)  # PhiMoE's training forward draws: the same draws each run
        spy = ExpertsSpy(model, recompute)
        try:
            with replay(model, routes, layout=layout):
                loss = fn(**kwargs).float().square().mean()
                loss.backward()
        finally:
            spy.remove()
        return loss.detach(), spy

    eager, _ = run(lambda **kw: output(model, kw))
    if family not in NO_CHECKPOINTING:
        model.gradient_checkpointing_enable()
        try:
            ckpt, spy_ckpt = run(lambda **kw: output(model, kw), recompute=True)
        finally:
            model.gradient_checkpointing_disable()
        assert torch.equal(eager, ckpt)
        for j, (forced_T, want_TK) in enumerate(zip(forced_L, want_L, strict=True)):
            calls = chosen(spy_ckpt, j, family)
            assert len(calls) == 2  # the forward and its recompute
            for got_TK in calls:
                assert torch.equal(got_TK[forced_T], want_TK[forced_T])
    if family in EAGER_ATTENTION:
        for layer in model.model.layers:
            layer.self_attn.forward = torch.compiler.disable(layer.self_attn.forward)
    reset_dynamo()  # past Dynamo's recompile limit a frame would run eagerly
    graphs = Graphs(backend)
    loss_c, spy_c = run(torch.compile(lambda **kw: output(model, kw), backend=graphs))
    assert graphs.count > 0
    if family != "phimoe":  # its draws differ compiled
        torch.testing.assert_close(loss_c, eager, rtol=1e-5, atol=1e-6)
    for j, (forced_T, want_TK) in enumerate(zip(forced_L, want_L, strict=True)):
        (got_TK,) = chosen(spy_c, j, family)
        assert torch.equal(got_TK[forced_T], want_TK[forced_T])
