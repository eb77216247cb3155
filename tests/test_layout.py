"""The tree's architecture, checked from the code: which concern may import which, no import
cycles, the ledger free of vLLM, production free of development helpers; and every module or
class path the docs, examples and images name really imports.

The arrows (README.md, "The parts"): stages -> kv -> sched -> pipeline -> observability ->
transfers, each also to everything further right but kv to pipeline, and stages, kv ->
kv.transport. ``transfers`` (the ledger and omni_kv_config) and ``kv.transport``
(ZeroMQ) import nothing else of omni_runtime; ``devtools`` may import anything and nothing
imports it.
"""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "omni_runtime"
OPERATOR = ROOT / "operator" / "omni_operator"
#: The stage contract (engineArgs rules, the kv-transfer-config composition) that the operator
#: and omni-stage both enforce with the same code: a package of its own because the operator
#: may not import omni_runtime (its image has neither vLLM nor the runtime) and the runtime
#: may not import the operator. Both images carry it, so it imports the standard library only.
CONTRACT = ROOT / "omni_contract"

#: concern -> the concerns it may import (besides itself). Order matters only for lookup:
#: the longest matching prefix names a module's concern.
ALLOWED: dict[str, set[str]] = {
    "transfers": set(),
    "kv.transport": set(),
    "observability": {"transfers"},
    "pipeline": {"observability"},
    "sched": {"transfers", "observability", "pipeline"},
    "kv": {"sched", "transfers", "observability", "kv.transport"},
    "stages": {"kv", "kv.transport", "sched", "transfers", "observability", "pipeline"},
    "devtools": {"kv", "kv.transport", "sched", "transfers", "observability", "stages",
                 "pipeline"},
    "": set(),  # omni_runtime/__init__.py
}
#: Third-party packages the ledger must not import (it is the bookkeeping alone).
HEAVY = {"vllm", "torch", "transformers", "zmq", "prometheus_client", "opentelemetry"}


def _module_name(path: Path, package_root: Path, package: str) -> str:
    rel = path.relative_to(package_root).with_suffix("")
    parts = [package, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions (lazy imports are
    arrows too), relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from pkg import module`` imports pkg.module
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _runtime_graph() -> dict[str, set[str]]:
    modules = {_module_name(p, RUNTIME, "omni_runtime"): p for p in RUNTIME.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path, name) if m in modules and m != name}
    return graph


def _concern(module: str) -> str:
    rest = module.removeprefix("omni_runtime").lstrip(".")
    for concern in sorted(ALLOWED, key=len, reverse=True):
        if concern and (rest == concern or rest.startswith(concern + ".")):
            return concern
    assert rest == "", f"{module} is in no concern of tests/test_layout.py's ALLOWED table"
    return ""


GRAPH = _runtime_graph()


def test_every_runtime_module_belongs_to_a_concern():
    for module in GRAPH:
        _concern(module)  # asserts


def test_the_concern_table_itself_is_acyclic():
    def visit(c: str, stack: tuple[str, ...]) -> None:
        assert c not in stack, f"concern cycle: {' -> '.join(stack + (c,))}"
        for d in ALLOWED[c]:
            visit(d, stack + (c,))

    for c in ALLOWED:
        visit(c, ())


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_follow_the_arrows(module):
    mine = _concern(module)
    for target in sorted(GRAPH[module]):
        theirs = _concern(target)
        if theirs == mine or target == "omni_runtime":
            continue
        assert theirs in ALLOWED[mine], (
            f"{module} ({mine or 'root'}) imports {target} ({theirs}): not an allowed arrow; "
            f"allowed from {mine!r}: {sorted(ALLOWED[mine])}")


def test_no_import_cycles_between_modules():
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH[m]):
            if state[d] == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state[d] == 0:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if state[m] == 0:
            visit(m, [])


def test_no_import_cycles_in_the_operator_or_the_contract():
    """omni_operator (and omni_contract) import one way too: no module reaches itself again,
    lazy imports included (local/cli.py starts local/run.py's supervisor; run.py never
    imports cli)."""
    for root, package in ((OPERATOR, "omni_operator"), (CONTRACT, "omni_contract")):
        modules = {_module_name(p, root, package): p for p in root.rglob("*.py")}
        graph = {name: {m for m in _imports(path, name) if m in modules and m != name}
                 for name, path in modules.items()}
        state: dict[str, int] = defaultdict(int)

        def visit(m: str, stack: list[str]) -> None:
            state[m] = 1
            stack.append(m)
            for d in sorted(graph[m]):
                if state[d] == 1:
                    pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
                if state[d] == 0:
                    visit(d, stack)
            stack.pop()
            state[m] = 2

        for m in sorted(graph):
            if state[m] == 0:
                visit(m, [])


#: The operator's packages -> those they may import (besides themselves and the package's
#: constants): three programs (the controller, the offline check, the local run) on two shared
#: packages; the controller and the local run never import each other.
OPERATOR_ALLOWED: dict[str, set[str]] = {
    "pipeline": set(),
    "health": {"pipeline"},
    "check": {"pipeline"},
    "controller": {"check", "health", "pipeline"},
    "local": {"check", "health", "pipeline"},
}


def test_the_operator_is_its_programs_each_a_package_with_arrows_one_way():
    top = {p.name for p in OPERATOR.iterdir() if p.suffix == ".py"}
    assert top == {"__init__.py"}, f"modules outside the operator's packages: {sorted(top - {'__init__.py'})}"
    packages = {p.name for p in OPERATOR.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(OPERATOR_ALLOWED), packages ^ set(OPERATOR_ALLOWED)
    for path in OPERATOR.rglob("*.py"):
        name = _module_name(path, OPERATOR, "omni_operator")
        mine = name.split(".")[1] if name.count(".") else ""
        for target in _imports(path, name):
            parts = target.split(".")
            if parts[0] != "omni_operator" or len(parts) < 2 or parts[1] not in OPERATOR_ALLOWED:
                continue  # another package, or the constants of omni_operator/__init__.py
            assert parts[1] == mine or parts[1] in OPERATOR_ALLOWED[mine], (
                f"{name} imports {target}: {mine} may import {sorted(OPERATOR_ALLOWED[mine])}")


def test_the_transfer_bookkeeping_imports_no_engine_or_io_library():
    for path in (RUNTIME / "transfers").rglob("*.py"):
        name = _module_name(path, RUNTIME, "omni_runtime")
        heavy = {m for m in _imports(path, name) if m.split(".")[0] in HEAVY}
        assert not heavy, f"{name} imports {sorted(heavy)}"


def test_the_transport_and_the_packages_kv_and_observability_import_nothing_heavy_at_import():
    """A receiving stage imports omni_runtime.kv.transport, which runs omni_runtime/kv/__init__:
    that must not pull vLLM or torch in; observability/__init__ must not fix
    prometheus_client's mode before the stage sets its multiprocess directory."""
    for init in (RUNTIME / "kv" / "__init__.py", RUNTIME / "observability" / "__init__.py"):
        assert not _imports(init, "x"), f"{init.relative_to(ROOT)} imports something"


def test_nothing_in_production_imports_development_helpers_or_the_operator():
    for module in GRAPH:
        if _concern(module) == "devtools":
            continue
        bad = {t for t in GRAPH[module] if _concern(t) == "devtools"}
        assert not bad, f"{module} imports development helpers {sorted(bad)}"
    for path in RUNTIME.rglob("*.py"):
        name = _module_name(path, RUNTIME, "omni_runtime")
        for target in _imports(path, name):
            assert target.split(".")[0] not in {"omni_operator", "kopf", "kubernetes"}, (
                f"{name} imports {target}: omni_runtime never imports the operator")


def test_the_stage_contract_imports_the_standard_library_only():
    import sys

    for path in CONTRACT.rglob("*.py"):
        name = _module_name(path, CONTRACT, "omni_contract")
        for target in _imports(path, name):
            top = target.split(".")[0]
            assert top == "omni_contract" or top in sys.stdlib_module_names or top == "__future__", (
                f"{name} imports {target}: the stage contract is shared by both images; stdlib only")


def test_the_operator_and_the_runtime_share_the_contract_not_each_other():
    """Both sides import omni_contract for the stage contract's rules (one source)."""
    runtime = {t for p in RUNTIME.rglob("*.py") for t in _imports(p, _module_name(p, RUNTIME, "omni_runtime"))}
    operator = {t for p in OPERATOR.rglob("*.py") for t in _imports(p, _module_name(p, OPERATOR, "omni_operator"))}
    assert any(t.startswith("omni_contract.engine_args") for t in runtime)
    assert any(t.startswith("omni_contract.engine_args") for t in operator)


def test_the_operator_imports_neither_vllm_nor_the_runtime():
    for path in OPERATOR.rglob("*.py"):
        name = _module_name(path, OPERATOR, "omni_operator")
        for target in _imports(path, name):
            assert target.split(".")[0] not in {"omni_runtime", "vllm", "torch"}, (
                f"{name} imports {target}: the operator starts stages as processes")


# ------------------------------------------------------------------ documented paths import
_DOC_FILES = [
    ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*.yaml")),
    *sorted((ROOT / "charts").rglob("*.md")), *sorted((ROOT / "charts").rglob("*.yaml")),
    *sorted((ROOT / "charts").rglob("*.txt")),
    *sorted(ROOT.rglob("Dockerfile*")), ROOT / "Makefile",
    *sorted(OPERATOR.rglob("*.py")),
]
_PATH = re.compile(r"\bomni_runtime(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
#: Names that look like paths but are not Python objects (tracer instrumentation names).
_NOT_PATHS = {"omni_runtime.kv_transfer", "omni_runtime.kv_connector"}


def _documented_paths() -> list[tuple[str, str]]:
    found: dict[str, str] = {}
    for f in _DOC_FILES:
        if f.is_file() and ".venv" not in f.parts:
            for m in _PATH.finditer(f.read_text(errors="replace")):
                found.setdefault(m.group(0).rstrip("."), str(f.relative_to(ROOT)))
    return sorted(found.items())


def _resolve(dotted: str) -> object:
    """A module, or an attribute of the longest importable module prefix (how vLLM resolves
    --scheduler-cls and kv_connector_module_path)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize(("dotted", "where"), _documented_paths())
def test_every_documented_module_or_class_path_imports(dotted, where):
    if dotted in _NOT_PATHS:
        return
    try:
        _resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{where} names {dotted}, which does not import: {exc}")


def test_the_public_class_paths_and_console_scripts_resolve():
    from omni_runtime.kv.connector import OmniKVConnector
    from omni_runtime.sched import OmniARScheduler

    assert _resolve("omni_runtime.sched.OmniARScheduler") is OmniARScheduler
    assert _resolve("omni_runtime.kv.connector.OmniKVConnector") is OmniKVConnector
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"omni-stage", "omni-pipeline", "omni-operator"}
    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), target


_FILE = re.compile(r"(?<![\w/.-])(?:omni_contract|omni_runtime|operator/omni_operator|benchmarks|monitoring|examples)"
                   r"/[\w./-]*[\w/]")


def test_every_documented_file_path_exists():
    missing = []
    for f in _DOC_FILES:
        if f.is_file() and f.suffix in {".md", ".txt", ""}:
            for m in _FILE.finditer(f.read_text(errors="replace")):
                if not (ROOT / m.group(0)).exists():
                    missing.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "docs name files that do not exist:\n" + "\n".join(missing)
