"""Capture's hooks never read a tensor's value on the host, with every kind of cache.

On CUDA each such read (`.item()`, `int(t)`, `.tolist()`, `.cpu()`, `nonzero`, ...) waits for
the device; `test_cuda_sync.py` checks that with `torch.cuda.set_sync_debug_mode("error")`.
Here, on the CPU, a counter does it: those Tensor methods are wrapped to count the calls made
while one of `Capture`'s own hook functions runs (the decoder's pre- and post-forward
hooks, the router hooks, the peek at generate's mask). The HF experts loop calls `nonzero`
itself, so only capture's code is counted. Counts are kept per decoder forward: the prefill,
then one forward per decode step.

The old `past_columns` called `int(cache.get_seq_length(layer))` for every layer: a
StaticCache layer keeps its length in a device tensor, so that was one read (one sync on
CUDA) per attention layer per decode step; `test_the_counter_catches_the_old_per_layer_read`
runs that code again and counts it.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import transformers
from moe_models import tiny_model

from routing_replay import capture
from routing_replay.model.capture import Capture, _Recorder

CAPTURE = sys.modules["routing_replay.model.capture"]  # the module (`capture` is the function)
# Tensor methods that read a value to the host: each one is a device sync on CUDA.
READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__int__", "__index__", "__float__")
READS += ("__bool__", "__array__")
NEW = 4  # new tokens per generate call: the prefill, then 3 decode steps
PROMPT = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])  # row 0 left padded
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
FULL = torch.tensor([[9, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])  # no padding


class ReadCounter:
    """Counts host reads of tensors made inside Capture's hooks, per decoder forward."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active = False
        self.per_forward: list[list[str]] = []  # per decoder forward: the reads, by name
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        for name in ("_begin", "_end", "_outer_begin"):
            monkeypatch.setattr(Capture, name, self._inside(Capture.__dict__[name], name))
        record = _Recorder.__call__  # a router's hook
        monkeypatch.setattr(_Recorder, "__call__", self._inside(record, "router"))
        # generate's prepare step: capture's peek counts, transformers' prepare does not.
        prepare = Capture._prepare
        inside = self._inside(prepare, "p")

        def peek(cap, inner, *args, **kwargs):
            return inside(cap, self._outside(inner), *args, **kwargs)

        monkeypatch.setattr(Capture, "_prepare", peek)

    def _counted(self, method):
        counter = self

        def counted(t, *args, **kwargs):
            if counter.active and counter.per_forward:
                counter.per_forward[-1].append(method.__name__)
            return method(t, *args, **kwargs)

        return counted

    def _inside(self, fn, name):
        def run(*args, **kwargs):
            if name == "_begin":
                self.per_forward.append([])
            was, self.active = self.active, True
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = was

        return run

    def _outside(self, fn):
        def run(*args, **kwargs):
            was, self.active = self.active, False
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = was

        return run

    def counts(self) -> list[int]:
        return [len(reads) for reads in self.per_forward]


def old_past_columns(mask, cache, width, whole=False):
    """`past_columns` before this change, verbatim: an `int()` of every layer's length."""
    past = mask.shape[1] - width if isinstance(mask, torch.Tensor) and mask.dim() == 2 else 0
    if hasattr(cache, "get_seq_length"):
        for layer in range(max(len(cache), 1) if hasattr(cache, "__len__") else 1):
            with contextlib.suppress(ValueError, IndexError):
                past = max(past, int(cache.get_seq_length(layer)))
    return past


def generate(model, cache_implementation, prompt=PROMPT, mask=MASK, **kw):
    """Greedy generate under capture: (sequences, routes, token ids)."""
    if cache_implementation is not None:
        kw["cache_implementation"] = cache_implementation
    with capture(model) as cap, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            **kw,
        )
    return out, cap.routes(), cap.token_ids()


def lone_forward_routes(model, tokens: np.ndarray) -> np.ndarray:
    """Routes of one sample's tokens in a plain forward without cache or padding."""
    with capture(model) as cap, torch.no_grad():
        model(input_ids=torch.from_numpy(tokens)[None], use_cache=False)
    return cap.routes()[0]


def cache_kinds(model, cache_implementation):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {} if cache_implementation is None else {"cache_implementation": cache_implementation}
        out = model.generate(
            FULL, max_new_tokens=2, do_sample=False, return_dict_in_generate=True, **kw
        )
    cache = out.cache
    return type(cache).__name__, [type(layer).__name__ for layer in cache.layers]


# (family, cache_implementation, the cache generate builds, its layer kinds)
CASES = [
    ("qwen3_moe", None, "DynamicCache", ["DynamicLayer"] * 3),
    ("qwen3_moe", "static", "StaticCache", ["StaticLayer"] * 3),
    # Sliding layers keep their length in a python int, full ones in a tensor.
    ("gpt_oss", "static", "StaticCache", ["StaticSlidingWindowLayer", "StaticLayer"]),
    # Hybrid: gated-DeltaNet linear attention in layer 0, full attention in layer 1.
    ("qwen3_5_moe", None, "DynamicCache", ["LinearAttentionLayer", "DynamicLayer"]),
    ("qwen3_5_moe", "static", "StaticCache", ["LinearAttentionLayer", "StaticLayer"]),
    # MiniMax: its own hybrid cache (layer 0 linear attention reports 0 tokens); transformers
    # ignores cache_implementation="static" for it.
    ("minimax", None, "MiniMaxCache", ["DynamicLayer", "DynamicLayer"]),
]


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
@pytest.mark.parametrize(("family", "impl", "cache_name", "layer_kinds"), CASES)
def test_no_host_reads_in_capture_hooks_and_routes_match_lone_forwards(
    monkeypatch, family, impl, cache_name, layer_kinds, padded
):
    # Left padded, generate keeps its 2-D mask; without padding it drops it, and capture has
    # only the cache to go by.
    model = tiny_model(family)
    assert cache_kinds(model, impl) == (cache_name, layer_kinds)
    prompt, mask = (PROMPT, MASK) if padded else (FULL, None)
    counter = ReadCounter(monkeypatch)
    out, routes, tokens = generate(model, impl, prompt=prompt, mask=mask)
    assert counter.counts() == [0] * NEW  # the prefill and every decode step: no read
    monkeypatch.undo()
    # Padding stripped, prompt + generated tokens, each route row that token's routes in a
    # plain forward of the sample alone (the last token was never forwarded: -1).
    real = [
        row[m.bool()].tolist() for row, m in zip(prompt, MASK if padded else FULL > 0, strict=True)
    ]
    assert [t.tolist() for t in tokens] == [r + out[b, 6:].tolist() for b, r in enumerate(real)]
    for sample_tokens, sample_routes in zip(tokens, routes, strict=True):
        assert np.array_equal(sample_routes[:-1], lone_forward_routes(model, sample_tokens[:-1]))
        assert (sample_routes[-1] == -1).all()


@pytest.mark.parametrize(("family", "impl"), [(c[0], c[1]) for c in CASES])
def test_routes_equal_the_old_code_path_without_padding(monkeypatch, family, impl):
    model = tiny_model(family)
    new = generate(model, impl, prompt=FULL, mask=None)
    monkeypatch.setattr(CAPTURE, "past_columns", old_past_columns)
    old = generate(model, impl, prompt=FULL, mask=None)
    assert torch.equal(new[0], old[0])
    for a, b in zip(new[1] + new[2], old[1] + old[2], strict=True):
        assert np.array_equal(a, b)


def test_the_counter_catches_the_old_per_layer_read(monkeypatch):
    # StaticCache, 3 attention layers: the old code read each layer's length tensor on every
    # decode step (the prefill's fresh cache reports a python 0).
    model = tiny_model("qwen3_moe")
    counter = ReadCounter(monkeypatch)
    monkeypatch.setattr(CAPTURE, "past_columns", old_past_columns)
    generate(model, "static", prompt=FULL, mask=None)
    assert counter.counts() == [0, 3, 3, 3]
    assert {name for reads in counter.per_forward for name in reads} == {"__int__"}


def test_static_cache_left_padding_is_stripped(family="qwen3_moe"):
    # With a StaticCache the decoder gets a 4-D mask; capture takes the 2-D one from
    # generate's prepare step. The old code kept the padding rows (8 rows for sample 0).
    model = tiny_model(family)
    dyn_out, dyn_routes, dyn_tokens = generate(model, None)
    out, routes, tokens = generate(model, "static")
    assert torch.equal(out, dyn_out)
    assert [len(r) for r in routes] == [4 + NEW, 6 + NEW]
    for a, b in zip(routes + tokens, dyn_routes + dyn_tokens, strict=True):
        assert np.array_equal(a, b)


def test_chunked_prefill_on_an_early_initialized_static_cache_reads_once(monkeypatch):
    # prefill_chunk_size: generate initializes the StaticCache before the first chunk, so its
    # length is a tensor from the start; without padding generate drops the mask. Capture reads
    # it once, at the first chunk, then counts: the 3 chunks and the decode steps read nothing.
    model = tiny_model("qwen3_moe")
    counter = ReadCounter(monkeypatch)
    out, routes, tokens = generate(model, "static", prompt=FULL, mask=None, prefill_chunk_size=2)
    assert counter.counts() == [1, 0, 0] + [0] * (NEW - 1)
    monkeypatch.undo()
    ref = generate(model, None, prompt=FULL, mask=None)
    assert torch.equal(out, ref[0])
    for a, b in zip(routes + tokens, ref[1] + ref[2], strict=True):
        assert np.array_equal(a, b)
    # With padding, generate keeps the 2-D mask, so even the first chunk reads nothing.
    counter = ReadCounter(monkeypatch)
    out, routes, _ = generate(model, "static", prefill_chunk_size=2)
    assert counter.counts() == [0] * (3 + NEW - 1)
    monkeypatch.undo()
    dyn = generate(model, None)
    assert torch.equal(out, dyn[0]) and all(
        np.array_equal(a, b) for a, b in zip(routes, dyn[1], strict=True)
    )


@pytest.mark.parametrize("with_mask", [True, False])
def test_hand_written_static_cache_loop(monkeypatch, with_mask):
    # Outside generate capture cannot know the StaticCache was not reset or cropped in place:
    # with the 2-D mask of the whole sequence it reads nothing, without it one read per forward.
    model = tiny_model("qwen3_moe")

    def loop(cache):
        sequence = FULL
        with capture(model) as cap, torch.no_grad():
            for step in range(3):
                inputs = sequence if step == 0 else sequence[:, -1:]
                mask = torch.ones_like(sequence) if with_mask else None
                out = model(input_ids=inputs, attention_mask=mask, cache=cache, use_cache=True)
                sequence = torch.cat([sequence, out.logits[:, -1:].argmax(-1)], dim=1)
        return cap.routes(), cap.token_ids()

    dynamic = loop(transformers.DynamicCache(config=model.config))
    counter = ReadCounter(monkeypatch)
    static = loop(transformers.StaticCache(config=model.config, max_cache_len=16))
    assert counter.counts() == ([0, 0, 0] if with_mask else [0, 1, 1])
    assert {n for reads in counter.per_forward for n in reads} <= {"__int__"}
    for a, b in zip(static[0] + static[1], dynamic[0] + dynamic[1], strict=True):
        assert np.array_equal(a, b)


def test_one_thread_captures_a_model_at_a_time():
    """Blocks in two threads would each record the other's forwards: refused (the check and
    the mark are one step); nested blocks in one thread stay allowed (tested elsewhere)."""
    import threading

    from routing_replay import RoutingReplayError
    from routing_replay.testing import tiny_moe

    model = tiny_moe()
    entered, errors, done = threading.Barrier(2), [], []

    def worker():
        entered.wait()
        try:
            with capture(model) as cap:
                time.sleep(0.3)
                model(input_ids=torch.tensor([[3, 4, 5]]))
            done.append(len(cap.routes()))
        except RoutingReplayError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done == [1] and len(errors) == 1  # one block got in, and saw only its forward
    assert "another thread or asyncio task has a capture block active" in errors[0]
    with capture(model) as cap:  # the mark is gone after the blocks
        model(input_ids=torch.tensor([[3, 4, 5]]))
    assert len(cap.routes()) == 1


def test_a_forward_over_positions_already_forwarded_starts_a_new_sample():
    # A loop that crops its cache and forwards the same positions again (a rejected draft; a
    # diffusion decoder's next step): before, its routes ran on after the first forwards'
    # as one longer sample, every row from there on at the wrong position.
    model = tiny_model("qwen3_moe")
    width = FULL.shape[1]
    first, again = FULL[:, :2] + 1, FULL[:, :3] + 2
    cache = transformers.DynamicCache(config=model.config)
    with capture(model) as cap, torch.no_grad():
        model(input_ids=FULL, cache=cache, use_cache=True)
        model(input_ids=first, cache=cache, use_cache=True)  # continues: one sample
        cache.crop(-first.shape[1])  # back to the prompt
        model(input_ids=again, cache=cache, use_cache=True)  # positions width.. again
    tokens = [t.tolist() for t in cap.token_ids()]
    assert tokens == torch.cat([FULL, first], 1).tolist() + again.tolist()
    with capture(model) as alone, torch.no_grad():  # the same positions, forwarded once
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=FULL, cache=cache, use_cache=True)
        model(input_ids=again, cache=cache, use_cache=True)
    batch = FULL.shape[0]
    for got, want in zip(cap.routes()[batch:], alone.routes(), strict=True):
        assert np.array_equal(got, want[width:])


def test_loops_stepped_in_turn_over_two_caches_keep_their_samples_apart():
    # Two hand-written decode loops, one cache each, stepped round-robin in one block: before,
    # joined by position alone, loop B's prompt ran on with loop A's next token.
    model = tiny_model("qwen3_moe")
    caches = [transformers.DynamicCache(config=model.config) for _ in range(2)]
    prompts = [FULL, FULL + 1]
    steps = [[FULL[:, :1] + 3 * k + i for k in range(2)] for i in range(2)]
    with capture(model) as cap, torch.no_grad():
        for i in range(2):
            model(input_ids=prompts[i], cache=caches[i], use_cache=True)
        for k in range(2):
            for i in range(2):
                model(input_ids=steps[i][k], cache=caches[i], use_cache=True)
    want = [torch.cat([prompts[i], *steps[i]], 1) for i in range(2)]
    assert [t.tolist() for t in cap.token_ids()] == [row.tolist() for w in want for row in w]
    for i in range(2):  # each loop's routes are those of its sequence forwarded at once
        with capture(model) as alone, torch.no_grad():
            model(input_ids=want[i])
        for got, exact in zip(cap.routes()[2 * i : 2 * i + 2], alone.routes(), strict=True):
            assert np.array_equal(got, exact)


def test_assisted_decoding_is_refused_and_a_failed_generate_leaves_no_samples():
    from routing_replay.errors import UnsupportedGenerationError

    model = tiny_model("qwen3_moe")

    class Fails(transformers.StoppingCriteria):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if self.calls == 3:
                raise MemoryError("out of memory at decode step 3")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    settings = {"max_new_tokens": 4, "eos_token_id": None, "do_sample": False}
    with capture(model) as cap, torch.no_grad():
        with pytest.raises(UnsupportedGenerationError, match="prompt_lookup_num_tokens"):
            model.generate(FULL, prompt_lookup_num_tokens=2, **settings)
        with pytest.raises(MemoryError):
            model.generate(FULL, stopping_criteria=[Fails()], **settings)
        assert cap.routes() == []  # nothing of either call
        out = model.generate(FULL, **settings)  # the retry: its samples alone
    with capture(model) as again, torch.no_grad():
        assert torch.equal(model.generate(FULL, **settings), out)
    assert [t.tolist() for t in cap.token_ids()] == out.tolist()
    for got, want in zip(cap.routes(), again.routes(), strict=True):
        assert np.array_equal(got, want)


def test_capture_blocks_of_two_asyncio_tasks_on_one_model_are_refused():
    # Two coroutines on one event loop (an async actor or server), each with its own block:
    # before, allowed as one thread's nested blocks, so each recorded the other's generate.
    import asyncio

    from routing_replay import RoutingReplayError

    model = tiny_model("qwen3_moe")
    entered = asyncio.Event()
    outcome = {}

    async def request(name, prompt, first):
        try:
            with capture(model) as cap, torch.no_grad():
                if first:
                    entered.set()
                    await asyncio.sleep(0.05)  # the other request runs meanwhile
                model.generate(prompt, max_new_tokens=2, eos_token_id=None, do_sample=False)
            outcome[name] = [t.tolist() for t in cap.token_ids()]
        except RoutingReplayError as e:
            outcome[name] = str(e)

    async def main():
        a = asyncio.create_task(request("a", FULL, True))
        await entered.wait()
        await request("b", FULL + 1, False)
        await a

    asyncio.run(main())
    assert "another thread or asyncio task has a capture block active" in outcome["b"]
    assert [row[:6] for row in outcome["a"]] == FULL.tolist()  # a's own sample alone
    assert len(outcome["a"]) == 2
