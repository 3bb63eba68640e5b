"""Optional dependencies: each capability's packages come with one extra of medray (pyproject.toml), and a missing
one says which extra installs it."""
from __future__ import annotations

import importlib
from types import ModuleType

#: The extras of pyproject.toml and what each one is for (the error message quotes it).
EXTRAS = {
    "medical": "the HPO world, MedCAT, BM25/FAISS retrieval, the MiniLM encoder and benchmark loaders",
    "vision": "the imaging tools (BiomedCLIP, scikit-image)",
    "judge": "LLM-judge and BERTScore rewards",
    "wandb": "the Weights & Biases logger",
    "bench": "the benchmarks against other libraries",
}


def require(module: str, extra: str) -> ModuleType:
    """Import `module`; if its package is not installed, raise an ImportError that names the extra installing it.

    A package that is installed but fails on a dependency of its own re-raises that error unchanged: that is a
    broken install, which another extra would not fix."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; one of {sorted(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != module.split(".")[0]:
            raise
        raise ImportError(f"{module.split('.')[0]} is not installed; {EXTRAS[extra]} need medray's `{extra}` extra: "
                          f"pip install 'medray[{extra}]'", name=e.name) from e


def installed_version(distribution: str, extra: str) -> str:
    """The installed version of `distribution` (caches are keyed by it), or the ImportError naming its extra."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(distribution)
    except PackageNotFoundError:
        raise ImportError(f"{distribution} is not installed; {EXTRAS[extra]} need medray's `{extra}` extra: "
                          f"pip install 'medray[{extra}]'", name=distribution) from None
