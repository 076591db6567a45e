"""How a router's output carries its choice: where capture reads the ids, and how replay
writes forced ids and their weights back into the same output.

`Triple`: `(scores_TE, weights_TK, ids_TK, *rest)`, what nearly every transformers 5.x router
returns and its MoE block hands to the experts. `Scatter`: Llama 4's `(scores_TE, logits_TE)`,
the chosen experts' weights scattered into a `[T, E]` matrix (0 elsewhere) that the block
multiplies every expert's output by. `Pair`: DBRX's `(weights_TK, ids_TK)` from a method of
its MoE block given the logits. `SkipExpert`: Zaya's triple, whose router rewrites its skip
expert (id E, no compute) to id 0 with weight 0 before the experts see it. `SharedGammas`:
Inkling's triple plus the shared experts' gammas, normalised with the chosen weights.
`InputRounded`: Ergo's triple, its weights rounded to its input's dtype.
`Sorted`: JetMoE's 5-tuple, the token-expert pairs sorted by expert. `ProductKeys`: Doge's
MoE block, which picks its product-key experts inline and returns `(hidden, router_logits)`:
forced, the block's output is recomputed at the forced ids. A forced output keeps the rows
whose routes are missing (`missing_T1`, or None when none is) as the router made them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from routing_replay.model.scores import ScoreFunction


class Triple:
    """`(scores_TE, weights_TK, ids_TK, *rest)`: forced ids and their weights replace the
    middle two; the scores (and anything after) stay the router's own."""

    def ids(self, module: nn.Module, output: tuple) -> Tensor:
        return output[2]

    def rows(self, output: tuple) -> Tensor:
        """The tensor whose first dimension is the router's token count."""
        return output[2]

    def native(self, module: nn.Module, output: tuple, args: tuple) -> tuple[Tensor, Tensor]:
        """What the score function takes, and the router's own ids."""
        return output[0], output[2]

    def force(
        self,
        module: nn.Module,
        output: tuple,
        score: ScoreFunction,
        ids_TK: Tensor,
        missing_T1: Tensor | None,
        args: tuple = (),
    ) -> tuple:
        scores_TE, native_w_TK, native_ids_TK = output[:3]
        weights_TK = self.weights(module, score(module, scores_TE, ids_TK), native_w_TK, args)
        ids_TK, weights_TK = _merged(ids_TK, weights_TK, native_ids_TK, native_w_TK, missing_T1)
        return (scores_TE, weights_TK, ids_TK, *output[3:])

    def weights(self, module: nn.Module, w_TK: Tensor, like_TK: Tensor, args: tuple) -> Tensor:
        """The score function's weights as the router returns its own: in `like_TK`'s dtype."""
        return w_TK.to(like_TK.dtype)


class InputRounded(Triple):
    """Ergo's triple, whose router rounds its float32 weights to its input's dtype and back
    (bfloat16 steps in a float32 tensor): forced weights are rounded the same way."""

    def weights(self, module: nn.Module, w_TK: Tensor, like_TK: Tensor, args: tuple) -> Tensor:
        if not args:
            raise TypeError(
                f"{type(module).__name__} was called without its input as a positional argument: "
                "replay rounds the forced weights to its dtype, as the router rounds its own"
            )
        return w_TK.to(args[0].dtype).to(like_TK.dtype)


class TopkOfLogits:
    """A form whose ids are not in the output: the top-k of the logits at `output[LOGITS]`
    (the router's own op), which the score function also takes."""

    LOGITS = 0

    def ids(self, module: nn.Module, output: tuple) -> Tensor:
        return torch.topk(output[self.LOGITS], module.top_k, dim=1).indices

    def rows(self, output: tuple) -> Tensor:
        return output[self.LOGITS]

    def native(self, module: nn.Module, output: tuple, args: tuple) -> tuple[Tensor, Tensor]:
        return output[self.LOGITS], self.ids(module, output)


class Scatter(TopkOfLogits):
    """Llama 4's `(scores_TE, logits_TE)`: the ids are the top-k of the logits (the router's
    own op); forced, `scores_TE` holds the score function's weights at the forced ids and 0
    elsewhere, in the router's dtype."""

    LOGITS = 1

    def force(
        self,
        module: nn.Module,
        output: tuple,
        score: ScoreFunction,
        ids_TK: Tensor,
        missing_T1: Tensor | None,
        args: tuple = (),
    ) -> tuple:
        native_TE, logits_TE = output[:2]
        weights_TK = score(module, logits_TE, ids_TK).to(native_TE.dtype)
        scores_TE = torch.zeros_like(native_TE).scatter(1, ids_TK, weights_TK)
        if missing_T1 is not None:
            scores_TE = torch.where(missing_T1, native_TE, scores_TE)
        return (scores_TE, logits_TE, *output[2:])


class Pair:
    """DBRX's `route_tokens_to_experts(logits_TE) -> (weights_TK, ids_TK)`, a method of its
    MoE block: the scores are the call's argument."""

    def ids(self, module: nn.Module, output: tuple) -> Tensor:
        return output[1]

    def rows(self, output: tuple) -> Tensor:
        return output[1]

    def native(self, module: nn.Module, output: tuple, args: tuple) -> tuple[Tensor, Tensor]:
        return args[0], output[1]

    def force(
        self,
        module: nn.Module,
        output: tuple,
        score: ScoreFunction,
        ids_TK: Tensor,
        missing_T1: Tensor | None,
        args: tuple = (),
    ) -> tuple:
        native_w_TK, native_ids_TK = output[:2]
        weights_TK = score(module, args[0], ids_TK).to(native_w_TK.dtype)
        ids_TK, weights_TK = _merged(ids_TK, weights_TK, native_ids_TK, native_w_TK, missing_T1)
        return (weights_TK, ids_TK)


class SkipExpert(Triple):
    """Zaya's `(logits_TE+1, weights_TK, ids_TK, router_states)`: the router picks among E
    experts and a skip expert, id E, then rewrites a chosen E to id 0 with weight 0 (the
    experts add nothing for it). The routes hold the choice before that rewrite (E: skipped,
    so the layout has E + 1 experts); forced ids and their weights are rewritten the same way.
    """

    def ids(self, module: nn.Module, output: tuple) -> Tensor:
        """The router's choice before the rewrite: E where it skipped. A skip left id 0 with
        weight 0; the router's own selection, redone from its logits, tells it from expert 0
        chosen with a weight that underflowed to 0."""
        _, weights_TK, ids_TK = output[:3]
        skip = module.num_experts
        with torch.no_grad():
            probs_TE = torch.softmax(output[0], dim=-1)  # the router's ops, on its logits
            biased_TE = probs_TE.to(torch.float32) + module.balancing_biases
            picked_TK = torch.topk(biased_TE, module.top_k, dim=-1).indices
            skipped_TK = (picked_TK == skip) & (ids_TK == 0) & (weights_TK == 0)
        return ids_TK.masked_fill(skipped_TK, skip)

    def native(self, module: nn.Module, output: tuple, args: tuple) -> tuple[Tensor, Tensor]:
        return output[0], self.ids(module, output)

    def force(
        self,
        module: nn.Module,
        output: tuple,
        score: ScoreFunction,
        ids_TK: Tensor,
        missing_T1: Tensor | None,
        args: tuple = (),
    ) -> tuple:
        scores_TE, native_w_TK, native_ids_TK = output[:3]
        weights_TK = score(module, scores_TE, ids_TK).to(native_w_TK.dtype)
        skipped_TK = ids_TK == module.num_experts  # as the router masks its own choice
        weights_TK = weights_TK.masked_fill(skipped_TK, 0)
        ids_TK = ids_TK.masked_fill(skipped_TK, 0)
        ids_TK, weights_TK = _merged(ids_TK, weights_TK, native_ids_TK, native_w_TK, missing_T1)
        return (scores_TE, weights_TK, ids_TK, *output[3:])


class SharedGammas(Triple):
    """Inkling's `(routed_logits_TE, weights_TK, ids_TK, gammas_TS)`: the chosen experts' weights
    and the S shared experts' gammas are normalised together, so forced ids change both. The
    score function takes the router's whole logits: the routed ones are its first output, the
    shared ones are not in its output and are recomputed from its input with its own op (the
    same float32 matmul over every row of its weight, so the same bits; the shared rows get
    their gradient through it). Weights and gammas are computed as the router does: float32,
    autocast off, then in the input's dtype."""

    def logits(self, module: nn.Module, output: tuple, args: tuple) -> Tensor:
        """The router's `[T, E + S]` logits: its routed output, then the shared experts'."""
        if not args:
            raise TypeError(
                f"{type(module).__name__} was called without its input as a positional argument: "
                "replay recomputes the shared experts' logits from it"
            )
        hidden = args[0]
        flat = hidden.reshape(-1, module.hidden_dim)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            all_TE = F.linear(flat.float(), module.weight.float())
        return torch.cat([output[0], all_TE[:, module.num_experts :]], dim=-1)

    def force(
        self,
        module: nn.Module,
        output: tuple,
        score: ScoreFunction,
        ids_TK: Tensor,
        missing_T1: Tensor | None,
        args: tuple = (),
    ) -> tuple:
        scores_TE, native_w_TK, native_ids_TK, native_g_TS = output[:4]
        logits_TE = self.logits(module, output, args)
        with torch.autocast(device_type=logits_TE.device.type, enabled=False):
            joint_TJ = score(module, logits_TE, ids_TK)
        joint_TJ = joint_TJ.to(native_w_TK.dtype)
        gammas_TS = joint_TJ[:, ids_TK.shape[1] :].contiguous()
        weights_TK = joint_TJ[:, : ids_TK.shape[1]].contiguous()
        ids_TK, weights_TK = _merged(ids_TK, weights_TK, native_ids_TK, native_w_TK, missing_T1)
        if missing_T1 is not None:
            gammas_TS = torch.where(missing_T1, native_g_TS, gammas_TS)
        return (scores_TE, weights_TK, ids_TK, gammas_TS, *output[4:])


class Sorted(TopkOfLogits):
    """JetMoE's `(index_sorted_experts, batch_index, batch_gates, expert_size, logits_TE)`: the
    T x K token-expert pairs sorted by expert (their flat index, their token, their gate), the
    pairs per expert (a list of ints), and the float logits. The ids are the top-k of the
    logits (the router's own op). Forced, the whole tuple is rebuilt from the forced ids (the
    router's own on missing rows) with the router's ops: gates by the score function in the
    router's dtype, counts per expert, the same sort of the flat ids."""

    LOGITS = 4

    def force(
        self,
        module: nn.Module,
        output: tuple,
        score: ScoreFunction,
        ids_TK: Tensor,
        missing_T1: Tensor | None,
        args: tuple = (),
    ) -> tuple:
        logits_TE, native_gates = output[4], output[2]
        if missing_T1 is not None:  # the router's own ids there: its own gates follow
            ids_TK = torch.where(missing_T1, self.ids(module, output), ids_TK)
        gates_TK = score(module, logits_TE, ids_TK).to(native_gates.dtype)
        flat_N = ids_TK.flatten()
        expert_size = torch.bincount(flat_N, minlength=module.num_experts).tolist()
        _, index_sorted_N = flat_N.sort(0)
        batch_index_N = index_sorted_N.div(module.top_k, rounding_mode="trunc")
        batch_gates_N = gates_TK.flatten()[index_sorted_N]
        return (index_sorted_N, batch_index_N, batch_gates_N, expert_size, logits_TE, *output[5:])


class ProductKeys:
    """Doge's MoE block (`DogeCDMoE`): its forward returns `(hidden_BSH, router_logits_2NK)`
    and picks its experts in between, with no router module: the logits' two halves score
    `num_keys` keys each (x and y, each `[N, num_keys]`), expert `e = ix * num_keys + iy`
    scores `x[ix] + y[iy]`, and the top-k of those sums are the ids. The ids are that choice
    redone from the logits with the block's own ops; the scores the score function takes are
    those sums for every expert, `[N, num_keys ** 2]`. Forced, the block's output is
    recomputed from its input with its own ops at the forced ids (its own on missing rows):
    the routed experts' embeddings looked up at them, weighted by the score function, plus
    its shared expert (so the block runs twice under replay: natively, then at the forced
    ids; the native output is dropped)."""

    def ids(self, module: nn.Module, output: tuple) -> Tensor:
        keys, logits_2NK = module.num_keys, output[1]
        with torch.no_grad():  # the block's ops, on its logits
            (x_NK, y_NK), (ix_NK, iy_NK) = logits_2NK.topk(keys, dim=-1)
            sums_NKK = x_NK.unsqueeze(-1) + y_NK.unsqueeze(-2)
            ids_NKK = ix_NK.unsqueeze(-1) * keys + iy_NK.unsqueeze(-2)
            slots_NK = sums_NKK.flatten(-2).topk(module.top_k, dim=-1).indices
            return ids_NKK.flatten(-2).gather(-1, slots_NK)

    def rows(self, output: tuple) -> Tensor:
        return output[1][0]

    def scores(self, output: tuple) -> Tensor:
        """Every expert's score, `[N, num_keys ** 2]`: expert e's is x[e // num_keys] +
        y[e % num_keys], the same sum the block takes top-k of."""
        x_NK, y_NK = output[1]
        return (x_NK.unsqueeze(-1) + y_NK.unsqueeze(-2)).flatten(-2)

    def native(self, module: nn.Module, output: tuple, args: tuple) -> tuple[Tensor, Tensor]:
        return self.scores(output), self.ids(module, output)

    def force(
        self,
        module: nn.Module,
        output: tuple,
        score: ScoreFunction,
        ids_TK: Tensor,
        missing_T1: Tensor | None,
        args: tuple = (),
    ) -> tuple:
        if not args:
            raise TypeError(
                f"{type(module).__name__} was called without its input as a positional argument: "
                "replay recomputes its output from it at the forced ids"
            )
        if missing_T1 is not None:  # the block's own ids there: its own weights follow
            ids_TK = torch.where(missing_T1, self.ids(module, output), ids_TK)
        weights_TK = score(module, self.scores(output), ids_TK)
        hidden_BSH = args[0]
        bsz, seq_len, _ = hidden_BSH.shape
        rows = bsz * seq_len
        down_TKH = module.down_embed(ids_TK)  # the block's ops from here on
        up_TKH = module.up_embed(ids_TK)
        experts_TK = torch.matmul(down_TKH, hidden_BSH.view(rows, -1, 1)).view(rows, -1)
        experts_TK = module.act_fn(experts_TK) * weights_TK
        experts_BSH = torch.matmul(experts_TK.view(rows, 1, -1), up_TKH).view(bsz, seq_len, -1)
        shared_BSH = module.down_proj(
            module.act_fn(module.gate_proj(hidden_BSH)) * module.up_proj(hidden_BSH)
        )
        return (shared_BSH + experts_BSH, *output[1:])


def _merged(
    ids_TK: Tensor, weights_TK: Tensor, native_ids_TK: Tensor, native_w_TK: Tensor, missing_T1: Any
) -> tuple[Tensor, Tensor]:
    """The forced (ids, weights), the router's own on the missing rows (None: no row is)."""
    if missing_T1 is None:
        return ids_TK, weights_TK
    return (
        torch.where(missing_T1, native_ids_TK, ids_TK),
        torch.where(missing_T1, native_w_TK, weights_TK),
    )


TRIPLE: Any = Triple()
INPUT_ROUNDED: Any = InputRounded()
PAIR: Any = Pair()
SCATTER: Any = Scatter()
SKIP_EXPERT: Any = SkipExpert()
SHARED_GAMMAS: Any = SharedGammas()
SORTED: Any = Sorted()
PRODUCT_KEYS: Any = ProductKeys()
