"""The floors hold: every project import (module level or inside a function) points down or sideways, never up, and
no module imports itself back through another; the core names no recipe.

    cluster  <-  tasks  <-  indexing  <-  actors, rewards  <-  recipes  <-  learners, serve
                                                                        (serve never imports learners)

learners imports the plugin registry (`recipes`, the package) and nothing of a recipe: a config's `recipe:` is
imported by name at run time.
"""
import re
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("cluster", "tasks", "indexing", "actors", "rewards", "recipes", "learners", "serve")
MAY_IMPORT = {"cluster": {"cluster"},
              "tasks": {"cluster", "tasks"},
              "indexing": {"cluster", "tasks", "indexing"},
              "actors": {"cluster", "tasks", "indexing", "actors", "rewards"},
              "rewards": {"cluster", "tasks", "indexing", "actors", "rewards"},
              "recipes": {"cluster", "tasks", "indexing", "actors", "rewards", "recipes"},
              "learners": {"cluster", "tasks", "indexing", "actors", "rewards", "recipes", "learners"},
              "serve": {"cluster", "tasks", "indexing", "actors", "rewards", "serve"}}


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


def test_the_core_never_imports_a_recipe_by_name():
    by_name = [f"{path.relative_to(ROOT)}:{line}: imports {name}" for module, path in modules().items()
               if not module.startswith("recipes.") for line, name in project_imports(path)
               if name.startswith("recipes.")]
    assert by_name == []


#: The files every run goes through; a recipe's code lives in its plugin, not here.
CORE = ("learners/trainer.py", "learners/config.py", "learners/services.py", "learners/metrics.py",
        "actors/rollout_worker.py", "actors/hooks.py", "recipes/__init__.py")
RECIPE_NAMES = ("Med-RwR", "Med-R3", "ARMed", "MedVR", "MedVistaGym", "EVR", "knowledge injection")


def test_core_files_carry_no_recipe_names():
    names = RECIPE_NAMES + tuple(p.stem for p in (ROOT / "recipes").glob("*.py") if p.stem != "__init__")
    pattern = re.compile("|".join(rf"\b{re.escape(n)}\b" for n in names), re.IGNORECASE)
    found = [f"{f}:{i}: {m.group()}" for f in CORE for i, line in enumerate((ROOT / f).read_text().splitlines(), 1)
             for m in pattern.finditer(line)]
    assert found == []


def test_actors_hold_no_builder_command_line():
    """Index builders and their command lines live in `indexing/` (and model builds in `tasks/`): a module of
    `actors/` is run by the roles, never as a program."""
    programs = [str(p.relative_to(ROOT)) for p in (ROOT / "actors").rglob("*.py")
                if "__main__" in p.read_text() or "argparse" in p.read_text()]
    assert programs == []


def test_one_episode_loop_drives_the_turn_logic():
    """Training's rollouts and serving's agent run one episode loop (`actors.episode.play`): no other module records a
    generation or an observation into an episode itself."""
    callers = [f"{p.relative_to(ROOT)}:{i}" for floor in FLOORS for p in (ROOT / floor).rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if re.search(r"\.(generated|observed)\(", line) and p != ROOT / "actors" / "episode.py"]
    assert callers == []
