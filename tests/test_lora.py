"""LoRA RL: adapters merged exactly, only changed layers synced, a run that trains adapters only and saves both."""
import copy
import json
import shutil

import pytest
import torch

from learners import lora
from learners.batches import load_causal_lm
from learners.config import ConfigError, load_config


@pytest.fixture
def adapted(tiny_model_path):
    """The tiny policy with rank-4 adapters on q, o and down, B made non-zero (as after training)."""
    model = lora.with_adapters(load_causal_lm(str(tiny_model_path), torch.float32), 4, 8.0, 0.0,
                               ["q_proj", "o_proj", "down_proj"])
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def test_merged_weights_equal_peft_merge_under_the_model_own_names(adapted, tiny_model_path):
    plain = load_causal_lm(str(tiny_model_path), torch.float32)
    merged = dict(lora.merged_weights(lora.policy(adapted)))
    assert sorted(merged) == sorted(n for n, _ in plain.named_parameters())
    reference = copy.deepcopy(adapted).merge_and_unload().state_dict()
    assert max((reference[k] - v).abs().max().item() for k, v in merged.items()) < 1e-6
    # the adapters changed q, o and down; every other weight is the model's own
    changed = [k for k, v in merged.items() if not v.equal(plain.state_dict()[k])]
    assert {k.rsplit(".", 2)[-2] for k in changed} == {"q_proj", "o_proj", "down_proj"}


def test_a_sync_sends_changed_layers_whole_fused_layers_included(adapted):
    sent = dict(lora.merged_weights(lora.policy(adapted), changed_only=True))
    # q_proj is fused with k and v in the engine (qkv_proj): all three are sent; gate/up were not touched
    assert {k.rsplit(".", 2)[-2] for k in sent} == {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"}
    assert not any(".lora_" in k or "base_layer" in k for k in sent)


def test_only_adapters_are_trainable_and_adapters_off_is_the_base_model(adapted, tiny_model_path):
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    ids = torch.tensor([[1, 5, 9, 3]])
    base = load_causal_lm(str(tiny_model_path), torch.float32)
    with adapted.disable_adapter():
        assert torch.allclose(lora.policy(adapted)(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6)
    assert not torch.allclose(lora.policy(adapted)(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-3)


def test_lora_with_zero3_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="learner.*zero_stage 1 or 2"):
        load_config("configs/tiny.yaml", ["learner.lora.rank=8", "learner.zero_stage=3"])


def test_a_target_module_the_model_lacks_is_refused_naming_the_choices(tiny_model_path):
    from transformers import AutoConfig

    from learners.memory_plan import meta_model, trainable_params

    cfg = load_config("configs/tiny.yaml", ["learner.lora.rank=8", "learner.lora.target_modules=[q_proj,qkv]"])
    config = AutoConfig.from_pretrained(tiny_model_path)
    refused = r"learner.lora.target_modules: \['qkv'\] name no linear layer of the model; choose among \[.*'q_proj'"
    with pytest.raises(ValueError, match=refused):  # the dry run and the check before Ray starts
        trainable_params(cfg, 0, config)
    with pytest.raises(ValueError, match=refused):  # the learner itself
        lora.with_adapters(meta_model(config), rank=8, alpha=16, dropout=0.0, target_modules=["q_proj", "qkv"])


def test_a_checkpoint_resumes_only_with_the_learner_that_wrote_it(tmp_path):
    from learners.checkpoint import refuse_other_learner

    (tmp_path / "lora" / "adapter").mkdir(parents=True)
    (tmp_path / "full").mkdir()
    refuse_other_learner(tmp_path / "lora", lora=True)
    refuse_other_learner(tmp_path / "full", lora=False)
    with pytest.raises(ValueError, match="written by a LoRA run, but the config trains every weight"):
        refuse_other_learner(tmp_path / "lora", lora=False)
    with pytest.raises(ValueError, match="written by a full fine-tuning run, but the config trains LoRA adapters"):
        refuse_other_learner(tmp_path / "full", lora=True)


@pytest.mark.slow
def test_a_lora_run_trains_adapters_syncs_them_and_checkpoints_adapter_and_merged_model(ray_session, tiny_model_path,
                                                                                      tmp_path):
    """Four GRPO steps with LoRA and a KL term (the reference: adapters off): after every sync the engine's
    log-probabilities equal the learner's, a sync moves less than the whole model, the checkpoint holds a merged
    model (loaded by transformers) equal to the adapter applied to the base model with PEFT, and a run resumed from
    step 2 takes steps 3 and 4 as the uninterrupted run did."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from test_training_e2e import run
    out = tmp_path / "run"
    lora_run = ["learner.lora.rank=4", "learner.lora.alpha=16", "learner.lr=0.01", "algorithm.kl_beta=0.01",
                "total_steps=4"]
    metrics = run(out, *lora_run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["fidelity_max_abs_diff"] <= 1e-4 for m in metrics)
    # the tiny model's first reward (a gradient) comes at step 3: at step 4 the policy has moved from the reference
    assert metrics[2]["grad_norm"] > 0 and metrics[3]["kl"] > 0
    whole_mb = (tiny_model_path / "model.safetensors").stat().st_size / 2**20
    assert all(0 < m["sync_mb"] < whole_mb for m in metrics)

    latest = out / "checkpoints" / "latest"
    adapter = json.loads((latest / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and (latest / "adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(latest).state_dict()
    initial = load_file(tiny_model_path / "model.safetensors")
    assert any(not merged[k].equal(v) for k, v in initial.items() if "q_proj" in k), "the adapters did not train"
    assert all(merged[k].equal(v) for k, v in initial.items() if "embed" in k or "norm" in k)
    applied = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), latest / "adapter")
    applied = applied.merge_and_unload().state_dict()
    assert max((applied[k] - merged[k]).abs().max().item() for k in initial) < 1e-5

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed, symlinks=True)
    for step in (3, 4):
        shutil.rmtree(resumed / "checkpoints" / f"step_{step}")
    (resumed / "metrics.jsonl").write_text("".join(f"{json.dumps(m)}\n" for m in metrics[:2]))
    again = run(resumed, *lora_run, "resume=true")
    for step in (2, 3):
        for key in ("reward_mean", "loss", "grad_norm", "kl"):
            assert again[step][key] == pytest.approx(metrics[step][key], rel=1e-5, abs=1e-6), (step + 1, key)
