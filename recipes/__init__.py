"""Recipe plugins: what a recipe adds to the one trainer beyond its config, its rewards and its tools.

A config names its recipe, `recipe: <name>` or `recipe: {name: <name>, module: <module>, args: {...}}`. The module
(`recipes.<name>` unless `module` says otherwise) is imported by that name and registers a `Recipe` subclass with
`@register_recipe(<name>)`, as rewards register (rewards/registry.py); no core module imports a recipe by name.

A plugin has one small interface per seam, each a no-op by default:

    Args                  pydantic model of `recipe.args` (its own section of the config)
    check(cfg)            refuse a config it cannot run (raise ValueError); runs on every stage's resolved config
    rollout_hooks(cfg)    RolloutHooks (actors/hooks.py) the rollout workers run in a GRPO stage
    step_stats(services)  numbers for each GRPO step's metrics, read from the service actors by role
    demonstration_sources / write_demonstrations
                          SFT data it generates for `sft.data: <source>` (with `sft.args` its settings)
"""
from __future__ import annotations

import importlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from actors.hooks import RolloutHook


class NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Recipe:
    """The default plugin: a recipe that is its config alone. One instance per run (it may keep state)."""
    Args: type[BaseModel] = NoArgs
    demonstration_sources: tuple[str, ...] = ()

    def __init__(self, args: BaseModel | None = None):
        self.args = args if args is not None else self.Args()

    def check(self, cfg) -> None:
        """Raise ValueError naming the field when `cfg` (a RunConfig, one stage resolved) cannot run this recipe."""

    def rollout_hooks(self, cfg) -> list[RolloutHook]:
        """The hooks the rollout workers run in a GRPO stage whose resolved config is `cfg`."""
        return []

    def step_stats(self, services: dict[str, list]) -> dict[str, float]:
        """Numbers added to each GRPO step's metrics (name them `<recipe>/<what>`), about what happened since the
        previous call; `services`: the run's service actor handles by role (retriever, tool, judge). The trainer also
        calls it right after an evaluation and drops the answer, so the evaluation's work is not the next step's."""
        return {}

    def write_demonstrations(self, source: str, *, workers: list, tasks: list[dict], tokenizer, cfg, sft, seed: int,
                             path: Path) -> None:
        """Write an SFT stage's demonstrations JSONL for `sft.data: source` (one of `demonstration_sources`) to
        `path`, from the stage's config `cfg`, its training `tasks` and the current policy on the rollout
        `workers`."""
        raise NotImplementedError(f"{type(self).__name__} generates no {source!r} demonstrations")


RECIPES: dict[str, type[Recipe]] = {}


def register_recipe(name: str):
    def add(cls: type[Recipe]) -> type[Recipe]:
        if name in RECIPES and RECIPES[name] is not cls:
            raise ValueError(f"recipe {name!r} is registered twice")
        RECIPES[name] = cls
        return cls
    return add


class RecipeSpec(BaseModel):
    """`recipe:` of a run config; a plain string is its name."""
    model_config = ConfigDict(extra="forbid")

    name: str
    module: str | None = Field(None, description="the plugin's module; default recipes.<name>")
    args: dict = Field(default_factory=dict, description="the recipe's own settings (its plugin's Args)")

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, value):
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _plugin_and_args(self):
        validated_args(self)
        return self


def recipe_class(spec: RecipeSpec) -> type[Recipe]:
    """The Recipe class `spec` names, its module imported on first use."""
    if spec.name not in RECIPES:
        module = spec.module or f"recipes.{spec.name}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise
            raise ValueError(f"recipe {spec.name!r}: no module {module} (set recipe.module to the plugin's "
                             f"module)") from None
        if spec.name not in RECIPES:
            raise ValueError(f"recipe {spec.name!r}: module {module} registers no recipe of that name "
                             f"(@register_recipe({spec.name!r}))")
    return RECIPES[spec.name]


def validated_args(spec: RecipeSpec) -> BaseModel:
    """`spec.args` validated by its plugin's Args; an error names each bad field under recipe.args."""
    try:
        return recipe_class(spec).Args.model_validate(spec.args)
    except ValidationError as e:
        raise ValueError("; ".join(f"recipe.args.{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                   for err in e.errors())) from None


def load_recipe(spec: RecipeSpec | None) -> Recipe:
    """The run's plugin: the one `spec` names with its args, or the no-op Recipe for a config without one."""
    if spec is None:
        return Recipe()
    return recipe_class(spec)(validated_args(spec))
