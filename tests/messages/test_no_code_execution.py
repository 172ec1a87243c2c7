"""No code path turns message content (or any input) into code: no pickle, eval, exec or marshal, and
torch.load only with weights_only=True. Checked on the source, so a new call anywhere fails here."""

from __future__ import annotations

import ast
from tests.conftest import REPO

FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
# torch.load of the trainer's own checkpoint file (never message content): Megatron's model state carries
# Transformer Engine's `_extra_state` byte buffers, which weights_only refuses.
ALLOWED_UNSAFE_TORCH_LOAD = {"rollart/training/megatron_backend.py"}


def sources():
    for folder in ("rollart", "consumers", "scripts"):
        yield from sorted((REPO / folder).rglob("*.py"))


def offences(source: str, rel: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{rel}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if isinstance(func, ast.Name) and name in FORBIDDEN_CALLS:
            found.append(f"{rel}:{node.lineno} calls {name}()")
        if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch":
            safe = any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords)
            if not safe and rel not in ALLOWED_UNSAFE_TORCH_LOAD:
                found.append(f"{rel}:{node.lineno} torch.load without weights_only=True")
        if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "yaml":
            found.append(f"{rel}:{node.lineno} yaml.load (use yaml.safe_load)")
        if name in ("unpackb", "Unpacker") and any(k.arg in ("ext_hook", "object_hook", "object_pairs_hook")
                                                   for k in node.keywords):
            found.append(f"{rel}:{node.lineno} msgpack {name} with a hook that builds objects")
    return found


def test_no_source_file_unpickles_or_evaluates_input():
    found = [o for path in sources() for o in offences(path.read_text(), path.relative_to(REPO).as_posix())]
    assert found == []


def test_the_scan_catches_each_forbidden_form():
    probe = ("import pickle\nimport yaml, torch\neval('1')\ntorch.load('x')\ntorch.load('x', weights_only=True)\n"
             "yaml.load('a')\nimport msgpack\nmsgpack.unpackb(b'', ext_hook=f)\n")
    assert [f.split(" ", 1)[1] for f in offences(probe, "rollart/probe.py")] == [
        "imports pickle", "calls eval()", "torch.load without weights_only=True", "yaml.load (use yaml.safe_load)",
        "msgpack unpackb with a hook that builds objects"]
    assert offences("import torch\ntorch.load('x')\n", "rollart/training/megatron_backend.py") == []
