"""The package's layers: a module imports only from its own package or the ones its layer may use.

Every import counts, also those inside functions (a lazy import is still a dependency). See
docs/architecture.md for the picture this encodes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "phalanx"
BOTTOM = {"errors", "global_batch", "tensor_pieces", "rng", "atomic", "lifetime", "profile", "faults", "host"}

# What each part of the package may import besides itself. Anything not listed is refused.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "global_batch": {"errors"},
    "tensor_pieces": set(),
    "atomic": {"errors"},
    "lifetime": set(),
    "host": {"errors"},
    "rng": set(),
    "profile": set(),
    "faults": {"errors"},
    "comm": BOTTOM,
    "parallel": BOTTOM | {"comm"},  # the engine knows nothing of loaders
    "data": BOTTOM | {"comm"},  # loaders know nothing of the engine
    "elastic": BOTTOM | {"comm"},  # objects take part through a protocol, not by type
    "strategies": BOTTOM | {"comm", "parallel"},  # parameter servers, central storage: reductions and servers
    "tune": BOTTOM | {"comm"},  # the search (Optuna) and the trial's side of it, which px.fit reports through
    "train": BOTTOM | {"comm", "parallel", "data", "elastic", "strategies", "tune"},
    "doctor": BOTTOM | {"comm", "parallel", "data", "elastic", "strategies", "tune", "train"},
    "horovod": BOTTOM | {"comm", "parallel", "data", "elastic", "train", "strategies"},  # Horovod's API on phalanx
    "cli": BOTTOM | {"comm", "parallel", "data", "elastic", "strategies", "tune", "train", "doctor", "root"},
}


def part_of(module: str) -> str:
    """``phalanx.comm.runtime`` -> ``comm``; ``phalanx`` itself -> ``root``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "root"


def module_name(path: Path) -> str:
    relative = path.relative_to(SRC.parent).with_suffix("")
    parts = list(relative.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every phalanx module ``path`` imports, at any depth of its code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "phalanx")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = module_name(path).split(".")[:-1] if path.name != "__init__.py" else \
                    module_name(path).split(".")
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "phalanx":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = (SRC.parent / candidate.replace(".", "/")).with_suffix(".py").exists() or \
                    (SRC.parent / candidate.replace(".", "/")).is_dir()
                found.add(candidate if is_module else base)
    return found


MODULES = {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


@pytest.mark.parametrize("module", [m for m in MODULES if part_of(m) not in ("root", "__main__")])
def test_a_module_imports_only_what_its_layer_may(module: str) -> None:
    own = part_of(module)
    assert own in ALLOWED, f"{module}: the package '{own}' has no place in the layers; add it to ALLOWED and the docs"
    refused = sorted(target for target in imports_of(MODULES[module])
                     if part_of(target) != own and part_of(target) not in ALLOWED[own])
    assert not refused, f"{module} ({own}) imports {refused}, above or beside its layer"


def test_no_import_cycles_between_modules() -> None:
    graph = {name: {target for target in imports_of(path) if target in MODULES and target != name
                    and not MODULES[target].name == "__init__.py"}
             for name, path in MODULES.items()}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        for target in graph[node]:
            if target in trail:
                cycles.append(trail[trail.index(target):] + [target])
            elif target not in done:
                visit(target, trail + [target])
        done.add(node)

    done: set[str] = set()
    for name in graph:
        if name not in done:
            visit(name, [name])
    assert not cycles, f"import cycles: {cycles}"


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    """The walker finds lazy imports too (a rule that cannot see an import cannot fail)."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from phalanx.parallel.data_parallel import DataParallel\n    import phalanx.data\n")
    assert imports_of(lazy) >= {"phalanx.parallel.data_parallel", "phalanx.data"}


# Below the process's current communicator (comm/runtime.py) the generation is an object handed
# around: these modules build or use a Communicator and never look up the current one.
GENERATION_MODULES = ("phalanx.comm.operations", "phalanx.comm.scopes", "phalanx.comm.routing", "phalanx.comm.agreement",
                      "phalanx.comm.joining", "phalanx.comm.objects", "phalanx.comm.communicator",
                      "phalanx.comm.formation", "phalanx.comm.handles")
RUNTIME_STATE = ("_current", "_elastic", "_incarnation", "_alone")


@pytest.mark.parametrize("module", GENERATION_MODULES)
def test_a_generation_is_handed_to_the_code_that_forms_and_uses_it(module: str) -> None:
    assert "phalanx.comm.runtime" not in imports_of(MODULES[module]), \
        f"{module} imports the runtime: it must work on the Communicator it is given"


def test_nothing_but_the_runtime_reads_the_process_global_state() -> None:
    """Every other module goes through the runtime's functions (px.communicator(), px.rank(), ...)."""
    readers = sorted(
        name for name, path in MODULES.items() if name != "phalanx.comm.runtime"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in RUNTIME_STATE
        and isinstance(node.value, ast.Name) and node.value.id == "runtime")
    assert not readers, f"modules reading the runtime's globals directly: {readers}"


def test_the_parameter_server_wire_protocol_stays_in_strategies() -> None:
    """px.fit's loops see tasks and clients, never request kinds or reply statuses."""
    readers = sorted(name for name, path in MODULES.items()
                     if part_of(name) != "strategies" and "phalanx.strategies.protocol" in imports_of(path))
    assert not readers, f"modules outside strategies/ reading the wire protocol: {readers}"


def test_importing_phalanx_leaves_dynamo_unloaded() -> None:
    """torch._dynamo costs a second of start-up in every worker: loaded only by a script that compiles."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, phalanx; print('torch._dynamo' in sys.modules)"],
                            capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "False", loaded.stdout + loaded.stderr


def test_the_training_loop_knows_strategies_only_through_their_interface() -> None:
    """A new strategy is one new module: px.fit's loop imports strategies/base.py's interface, no strategy."""
    readers = sorted(f"{name} imports {imported}" for name, path in MODULES.items() if part_of(name) == "train"
                     for imported in imports_of(path)
                     if imported.startswith("phalanx.strategies") and imported != "phalanx.strategies.base")
    assert not readers, f"train/ modules importing a concrete strategy: {readers}"
