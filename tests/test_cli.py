"""The `medray` command: every subcommand listed, each running its module (a dry run here, which starts nothing)."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def medray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "learners.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_installed_script_is_the_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"medray": "learners.cli:main"}


def test_help_lists_every_command_and_each_command_has_its_own_help():
    listed = medray("--help")
    assert listed.returncode == 0, listed.stderr
    for command in ("train", "eval", "serve", "build-index", "expert", "dry-run", "build-model", "traces"):
        assert f"    {command}" in listed.stdout, command
    own = medray("eval", "--help")
    assert own.returncode == 0 and "--checkpoint" in own.stdout and "medray eval" in own.stdout
    assert medray("fly").returncode == 2


def test_dry_run_prints_the_plan_and_bad_input_names_the_field(tmp_path):
    plan = medray("dry-run", "--config", "configs/med_rwr_cluster.yaml")
    assert plan.returncode == 0, plan.stderr
    assert "learner-0" in plan.stdout and "rollout-0" in plan.stdout and "GPUs" in plan.stdout
    bad = medray("dry-run", "--config", "configs/tiny.yaml", "rollout.group_size=zero")
    assert bad.returncode == 2
    assert "rollout.group_size (command-line override)" in bad.stderr
