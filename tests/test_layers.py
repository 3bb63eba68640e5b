"""The floors hold: every project import (module level or inside a function) points down or sideways, never up, and
no module imports itself back through another.

    cluster  <-  tasks  <-  actors, rewards  <-  learners, serve      (serve never imports learners)
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("cluster", "tasks", "actors", "rewards", "learners", "serve")
MAY_IMPORT = {"cluster": {"cluster"},
              "tasks": {"cluster", "tasks"},
              "actors": {"cluster", "tasks", "actors", "rewards"},
              "rewards": {"cluster", "tasks", "actors", "rewards"},
              "learners": {"cluster", "tasks", "actors", "rewards", "learners"},
              "serve": {"cluster", "tasks", "actors", "rewards", "serve"}}


def project_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        found += [(node.lineno, name) for name in names if name.split(".")[0] in FLOORS]
    return found


def modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for floor in FLOORS
            for p in (ROOT / floor).rglob("*.py")}


def test_no_import_points_up_a_floor():
    upward = [f"{path.relative_to(ROOT)}:{line}: imports {name}" for module, path in modules().items()
              for line, name in project_imports(path) if name.split(".")[0] not in MAY_IMPORT[module.split(".")[0]]]
    assert upward == []


def test_no_import_cycles():
    known = modules()
    graph = {m: {n for _, n in project_imports(p) if n in known and n != m} for m, p in known.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
