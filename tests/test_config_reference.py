"""docs/TRAINING.md's key reference is the run config's schema: every key, its type, default and description."""
from learners.config import RunConfig
from learners.config_reference import DOC, documented, reference, rows


def test_the_training_doc_lists_every_key_of_the_schema_as_it_is():
    assert documented(DOC.read_text(encoding="utf-8")) == reference(), (
        "docs/TRAINING.md's config reference differs from the schema (learners/config.py RunConfig): regenerate it "
        "with `python -m learners.config_reference --write`")


def test_the_reference_names_each_key_as_a_config_writes_it_with_its_role_s_default():
    found = {key: (kind, default) for key, kind, default, _ in rows(RunConfig)}
    assert found["async"] == ("sync | one_step_off | fully_async", "sync")  # the alias a config writes
    assert found["cluster.rollout.threads"][1] == "2" and found["cluster.learner.num"][1] == "2"  # the roles' own
    assert found["cluster.autoscale"] == ("bool", "false") and "cluster.placement_timeout_s" in found
    assert "auto" in found["learner.compute_dtype"][0].split(" | ")
    assert found["retrieval.search.top_k"][0] == "int" and "rollout.grammar.top_k" not in found
    assert found["judge.kv_cache_gb"][1] == "0.5" and found["rollout.kv_cache_gb"][1] == "1.0"
    assert found["stages[].name"][1] == "required" and "tools.tools.<name>.replicas" in found
