"""The tiny model's tokenizer: phenotypes as whole tokens (model.tiny.term_tokens)."""
from learners.config import TinyModelConfig
from learners.data import load_tasks
from tasks.expert import phenotypes_of


def test_term_tokens_make_each_listed_phenotype_one_token(tiny_model_path):
    from transformers import AutoTokenizer

    from learners.tiny_models import ensure_tiny_model
    whole = AutoTokenizer.from_pretrained(ensure_tiny_model(TinyModelConfig(term_tokens=True)))
    pieces = AutoTokenizer.from_pretrained(tiny_model_path)  # the default build
    task = load_tasks("hpo:mcq_test")[0]
    phenotypes = phenotypes_of(task)
    for name in phenotypes:
        assert len(whole.encode(name, add_special_tokens=False)) == 1, name
    assert sum(len(pieces.encode(name, add_special_tokens=False)) for name in phenotypes) > 2 * len(phenotypes)
    question = task["messages"][-1]["content"]
    assert whole.decode(whole.encode(question, add_special_tokens=False)) == question  # nothing lost around them
    assert len(whole) > len(pieces) + 10_000  # ~11k disease-annotating HPO terms
