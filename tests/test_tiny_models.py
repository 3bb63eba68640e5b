"""The tiny model's tokenizer: phenotypes as whole tokens (model.tiny.term_tokens)."""
from tasks.tiny_models import TinyModelConfig
from learners.data import load_tasks


def test_term_tokens_make_each_listed_phenotype_one_token(tiny_model_path):
    from transformers import AutoTokenizer

    from tasks.tiny_models import ensure_tiny_model
    whole = AutoTokenizer.from_pretrained(ensure_tiny_model(TinyModelConfig(term_tokens=True)))
    pieces = AutoTokenizer.from_pretrained(tiny_model_path)  # the default build
    task = load_tasks("hpo:mcq_test")[0]
    phenotypes = task["metadata"]["phenotype_names"]
    for name in phenotypes:
        assert len(whole.encode(name, add_special_tokens=False)) == 1, name
    assert sum(len(pieces.encode(name, add_special_tokens=False)) for name in phenotypes) > 2 * len(phenotypes)
    question = task["messages"][-1]["content"]
    assert whole.decode(whole.encode(question, add_special_tokens=False)) == question  # nothing lost around them
    assert len(whole) > len(pieces) + 10_000  # ~11k disease-annotating HPO terms


def test_copy_batches_train_only_the_copy_of_a_list_seen_earlier():
    """model.tiny.copy_pretrain_steps: each row is noise, a list x, noise, <query>, x; only the second x is a label."""
    import torch

    from tasks.tiny_models import COPY_BATCH, COPY_LIST_TOKENS, COPY_MAX_GAP, copy_batch
    separator, vocab_ids = 7, torch.arange(100, 200)
    generator = torch.Generator().manual_seed(0)
    for max_prefix in (0, 150):
        ids, labels = copy_batch(generator, vocab_ids, separator, max_prefix)
        assert ids.shape == labels.shape and ids.shape[0] == COPY_BATCH
        k = int((labels[0] != -100).sum())
        assert COPY_LIST_TOKENS[0] <= k <= COPY_LIST_TOKENS[1]
        assert (labels[:, :-k] == -100).all() and torch.equal(labels[:, -k:], ids[:, -k:])
        assert (ids[:, -k - 1] == separator).all()
        assert ids.shape[1] <= max_prefix + COPY_MAX_GAP + 2 * k + 1
        starts = [j for j in range(ids.shape[1] - 2 * k) if torch.equal(ids[:, j:j + k], ids[:, -k:])]
        assert starts, "the copied list occurs before the separator"
