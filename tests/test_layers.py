"""The package's layering, read from the source: what may import what, and where private
APIs of dependencies are called."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = sorted((ROOT / "routing_replay").rglob("*.py"))
INTEGRATIONS = sorted((ROOT / "integrations").glob("*.py"))
ENGINES = ("vllm", "sglang", "megatron", "trl", "verl", "peft", "transformer_engine")
# What an integration may import of routing_replay: the public API and the shared helpers.
PUBLIC = {
    "routing_replay",
    "routing_replay.errors",
    "routing_replay.model.agreement",
    "routing_replay.model.replay",  # prepare_replay, Replay
    "routing_replay.ray",
    "routing_replay.store",
    "routing_replay.validate",
    "routing_replay.schema",
    "routing_replay.integrations",
    "routing_replay.integrations._reads",
    "routing_replay.integrations._rows",
    "routing_replay.integrations._compat_vllm",
    "routing_replay.integrations._compat_trl",
    # the parts of integrations.vllm and integrations.trl, re-exported there
    "routing_replay.integrations._vllm_hosts",
    "routing_replay.integrations._vllm_puts",
    "routing_replay.integrations._vllm_versions",
    "routing_replay.integrations._vllm_worker",
    "routing_replay.integrations._middleware_http",  # vllm_middleware's, re-exported there
    "routing_replay.integrations._trl_checkpoints",
    "routing_replay.integrations._trl_rollout",
    "routing_replay.integrations._trl_rows",
    "routing_replay.integrations.vllm",  # the vLLM server and middleware build on it
    "routing_replay.integrations.replay_metrics",  # every trainer integration logs with it
}
# Private APIs of dependencies, and the one module each may be called from.
PRIVATE = {
    r"torch\._C\b|torch\._dynamo\.eval_frame": "routing_replay/compat/torch.py",
    r"ray\._private": "routing_replay/compat/ray.py",
    r"driver_worker|model_executor|process_weights_after_loading": "integrations/_compat_vllm.py",
    r"_iter_named_params|\._step\b|vllm_generation\b|_disable_adapters": (
        "integrations/_compat_trl.py"
    ),
}


def imported(path: pathlib.Path) -> set[str]:
    """Every module `path` imports (absolute names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_core_never_imports_an_engine_or_an_integration():
    for path in CORE:
        bad = [
            m
            for m in imported(path)
            if m.split(".")[0] in ENGINES or m.startswith("routing_replay.integrations")
        ]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_integrations_use_only_the_public_api():
    for path in INTEGRATIONS:
        ours = {m for m in imported(path) if m.startswith("routing_replay")}
        assert ours <= PUBLIC, f"{path.relative_to(ROOT)} imports {sorted(ours - PUBLIC)}"


def test_private_apis_are_called_from_one_compat_module_each():
    for path in [*CORE, *INTEGRATIONS]:
        rel = str(path.relative_to(ROOT))
        code = _without_strings(
            "\n".join(  # comments and docstrings may name them
                line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
            )
        )
        for pattern, home in PRIVATE.items():
            if rel != home and re.search(pattern, code):
                raise AssertionError(f"{rel} calls a private API ({pattern}); only {home} may")


def _without_strings(code: str) -> str:
    """The source with string literals (docstrings, messages) blanked out."""
    lines = code.splitlines()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            first, last = node.lineno - 1, node.end_lineno - 1
            if first == last:
                line = lines[first]
                lines[first] = line[: node.col_offset] + line[node.end_col_offset :]
            else:
                lines[first : last + 1] = [""] * (last - first + 1)
    return "\n".join(lines)


def test_the_root_exports_a_small_surface_and_no_old_paths():
    import routing_replay

    assert len(routing_replay.__all__) <= 25
    assert all(getattr(routing_replay, name) is not None for name in routing_replay.__all__)
    for old in ("dataset", "rollout", "store_actor", "adapters", "_moved"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"routing_replay.{old}")
    with pytest.raises(AttributeError):
        routing_replay.fetch_batch  # noqa: B018  (it lives in routing_replay.ray)


def test_modules_over_400_lines_say_why_at_their_top():
    # One concept per module; one that reads better whole says so in its docstring's head.
    files = [*CORE, *INTEGRATIONS, *sorted((ROOT / "benchmarks").glob("*.py"))]
    long = [path for path in files if len(path.read_text().splitlines()) > 400]
    unexplained = [
        str(path.relative_to(ROOT))
        for path in long
        if "over 400 lines by design" not in " ".join(path.read_text()[:600].lower().split())
    ]
    assert unexplained == []
