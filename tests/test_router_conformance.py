"""Every router class of the installed transformers is known: replayed, refused by name, or
listed as not an MoE router. A new release's families fail here, not at users' (`.ci/newest`
runs this file on the newest transformers).

A class of a `models/*/modeling_*.py` module is a router candidate when its name says so
(ends in Router / Gate / Gating, or holds TopK) or when it picks experts itself (its code
takes a top-k, an argmax or a sort and mentions experts), and it selects (top-k, argmax, a
max, a sort, a table lookup). The scan reads the source (each top-level class up to the
next): nothing is imported or built.
"""

from __future__ import annotations

import functools
import itertools
import os
import re

import transformers

from routing_replay.model.adapters import NOT_ROUTERS, REFUSED, known_routers

MODELS = os.path.join(os.path.dirname(transformers.__file__), "models")
SELECTS = re.compile(r"\.topk\(|torch\.topk\(|argmax\(|\.sort\(|\.max\(dim|tid2eid\[|sparsemixer\(")
CLASS = re.compile(r"^class (\w+)\b", re.MULTILINE)  # top-level classes
NAMED = re.compile(r"(Router|Gate|Gating)$|TopK|Topk")
NOT_A_ROUTER_NAME = re.compile(r"Norm|MLP|DeltaNet|Projection|ActDense|Attention|Layer")
NOT_A_ROUTER_SUFFIX = (
    "Model",
    "Loss",
    "ForConditionalGeneration",
    "ForCausalLM",
    "PreTrainedModel",
    "Experts",
)


@functools.cache
def router_candidates() -> dict[str, str]:
    """Class name -> `model_dir/modeling_x.py` of every router candidate (see the docstring)."""
    found = {}
    for folder in sorted(os.listdir(MODELS)):
        path = os.path.join(MODELS, folder)
        if not os.path.isdir(path):
            continue
        for file in sorted(f for f in os.listdir(path) if f.startswith("modeling_")):
            with open(os.path.join(path, file), encoding="utf-8") as f:
                source = f.read()
            if not re.search(r"expert|router", source, re.IGNORECASE):
                continue
            starts = [m.start() for m in CLASS.finditer(source)] + [len(source)]
            for start, end in itertools.pairwise(starts):
                code = source[start:end]
                name = CLASS.match(code).group(1)
                selects = bool(SELECTS.search(code))
                named = bool(NAMED.search(name)) and not NOT_A_ROUTER_NAME.search(name)
                picks = (
                    selects
                    and re.search("expert", code, re.IGNORECASE)
                    and not name.endswith(NOT_A_ROUTER_SUFFIX)
                )
                if named or picks:
                    found[name] = f"{folder}/{file}"
    return found


def test_every_router_class_is_replayed_refused_or_not_a_router():
    candidates = router_candidates()
    assert len(candidates) > 50, "the scan found too few classes: transformers' layout changed?"
    known = set(known_routers()) | set(REFUSED) | NOT_ROUTERS
    unknown = sorted(f"{name} ({where})" for name, where in candidates.items() if name not in known)
    assert not unknown, (
        "router classes of this transformers neither replayed nor refused: add each to "
        "routing_replay/model/adapters.py (_SCORES with its score function and a test in "
        "tests/test_families.py, or REFUSED with why, or NOT_ROUTERS):\n" + "\n".join(unknown)
    )


def test_the_lists_are_disjoint_and_name_real_classes():
    replayed, refused = set(known_routers()), set(REFUSED)
    assert not replayed & refused and not replayed & NOT_ROUTERS and not refused & NOT_ROUTERS
    candidates = router_candidates()
    stale = sorted((replayed | refused | NOT_ROUTERS) - set(candidates))
    assert not stale, f"classes listed but not in this transformers: {stale}"


def test_docs_families_lists_every_class_once():
    """docs/families.md's table is the lists above, row for row (edit it with them)."""
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "families.md")
    with open(path, encoding="utf-8") as f:
        rows = [line.split("|")[1:4] for line in f if line.startswith("| `")]
    listed = {cls.strip().strip("`"): kind.strip() for cls, _, kind in rows}
    assert len(listed) == len(rows)
    want = {
        **dict.fromkeys(known_routers(), "replayed"),
        **dict.fromkeys(REFUSED, "refused"),
        **dict.fromkeys(NOT_ROUTERS, "not an MoE router"),
    }
    assert listed == want
