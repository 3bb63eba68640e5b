"""The run configuration: YAML validated into typed objects, with `dotted.key=value` overrides.

Every error names the file, the line (when the key is in the file) and the dotted field; reading the YAML (with
`extends:`) and the overrides is learners/config_loader.py.
"""
from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from actors.grammar import Grammar
from actors.gym import ToolsConfig
from actors.judge import JudgeConfig
from indexing.retrieval_index import IndexConfig
from actors.retriever import RetrievalConfig
from cluster.config import ClusterConfig
from cluster.engine import EngineSettings
from cluster.schema import Strict
from learners.budgets import check_budgets
# ConfigError and parse_override are re-exported: importers take them from here
from learners.config_loader import ConfigError, apply_overrides, parse_override, read_config  # noqa: F401
from learners.config_outputs import CheckpointConfig, EvalConfig, FaultToleranceConfig, LoggingConfig, StorageConfig
from recipes import RecipeSpec, load_recipe
from tasks.tiny_models import ModelConfig


class DataConfig(Strict):
    train: str | list[str] = Field(..., description="JSONL of task records, 'hpo:<split>' for the built-in HPO "
                                   "tasks, 'phenopackets:<path>#<split>' for real cases, or a list of these (mixed)")
    shuffle: bool = True
    max_prompt_tokens: int = Field(256, ge=8)


# The fidelity check's default tolerance per dtype: above the rounding by which engine and learner differ on identical
# weights, far below what a sync error does, so a check stops a broken sync and not kernel rounding (the measurements:
# docs/BENCHMARKS.md#fidelity). float16 takes bfloat16's, the looser (README *Known limits*).
FIDELITY_TOLERANCE = {"float32": 1e-3, "bfloat16": 4.0, "float16": 4.0}


class RolloutConfig(EngineSettings):
    """How rollouts are sampled, and the rollout workers' engines (built once per run: a stage cannot change the
    engine's settings or dtype)."""
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1, description="G rollouts per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)
    stop: list[str] = Field(default_factory=list, description="strings that end a generation (kept in the output)")
    grammar: Grammar = Grammar()
    fidelity_check_every: int = Field(0, ge=0, description="every N steps compare engine and learner logprobs (0: off)")
    fidelity_tolerance: float | None = Field(None, gt=0, description="max |engine - learner| logprob after a sync; "
                                                                      "null: the looser of FIDELITY_TOLERANCE"
                                                                      "[model.dtype] and [rollout.dtype]")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] | None = Field(
        None, description="the engine's weights (each sync casts the learner's to it); null: model.dtype. bfloat16 "
                          "samples faster where the device multiplies it natively, the learner keeping float32. "
                          "auto: bfloat16 for GPU rollouts and where the driver's CPU multiplies it natively "
                          "(AVX512-BF16, AMX), else model.dtype")

    def sampling(self) -> dict:
        """What every generation turn is sampled with (vLLM SamplingParams fields)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_new_tokens,
                "stop": self.stop}


class RolloutCorrection(Strict):
    """Correcting for the engine and the learner computing different probabilities for the same weights
    (learners/algorithm.py:rollout_correction): the PPO ratio is then taken against the learner's own behaviour
    log-probabilities, and each token's loss weighted by min(rho, cap) (tis) or rho, 0 above cap (mis)."""
    kind: Literal["none", "tis", "mis"] = Field("none", description="none: the ratio is taken against the engine's "
                                                                     "log-probabilities, uncorrected")
    cap: float = Field(2.0, gt=1, description="C of min(rho, C) (tis) or of the mask rho <= C (mis); > 1")


class AlgorithmConfig(Strict):
    """The RL objective (learners/algorithm.py): an advantage estimator and a clipped policy loss."""
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = Field(
        "grpo", description="grpo: (r - group mean) / group std (Shao et al. 2024); rloo: r - the mean of the other "
                            "rollouts of its prompt (Ahmadian et al. 2024); reinforce_pp: (r - group mean) / batch std "
                            "(REINFORCE++ with baseline, Hu et al. 2025)")
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="the importance ratio: token (PPO, GRPO) or sequence: exp of the mean of the rollout's "
                             "token log-ratios, clipped per rollout (GSPO, Zheng et al. 2025; its paper clips at "
                             "eps_low 3e-4, eps_high 4e-4, with loss_agg seq_mean)")
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.28, ge=0, description="> eps_low is DAPO's clip-higher")
    loss_agg: Literal["token_mean", "seq_mean", "token_sum_norm"] = Field(
        "token_mean", description="token_mean (DAPO), seq_mean (GRPO) or token_sum_norm (Dr.GRPO: sum / (B * L))")
    loss_norm_length: int | None = Field(None, ge=1, description="L of token_sum_norm; null: rollout.max_new_tokens")
    normalize_std: bool = Field(True, description="advantage grpo only: false is Dr.GRPO")
    kl_beta: float = Field(0.0, ge=0, description="0 runs no reference model")
    updates_per_batch: int = Field(1, ge=1, description="passes over each rollout batch")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal and sample more "
                                                      "prompts until the batch is full")
    max_extra_rounds: int = Field(3, ge=1, description="dynamic sampling: extra generation rounds per step at most; "
                                                       "a batch still short is filled with the dropped groups")
    rollout_correction: RolloutCorrection = RolloutCorrection()

    @model_validator(mode="after")
    def _std_is_grpo_s(self):
        if not self.normalize_std and self.advantage != "grpo":
            raise ValueError(f"normalize_std: false (Dr.GRPO) is a setting of advantage grpo; advantage "
                             f"{self.advantage} never divides by the group's std")
        return self


class LoraConfig(Strict):
    """Low-rank adapters trained instead of the whole policy (learners/lora.py); engines and checkpoints get the
    merged weights."""
    rank: int = Field(16, ge=1, description="r: each adapted weight W [out, in] gets B [out, r] A [r, in]")
    alpha: float = Field(32.0, gt=0, description="the adapters' product B A is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="on the adapters' input; > 0 makes the learner's first "
                                                         "forward differ from the policy that sampled")
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      min_length=1, description="names of the linear layers that get adapters")


class LearnerConfig(Strict):
    zero_stage: Literal[1, 2, 3] = Field(2, description="1: optimizer state partitioned, gradients reduced once per "
                                                         "optimizer step; 2: gradients partitioned too, reduced after "
                                                         "every micro-batch; 3: weights partitioned too")
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1, description="sequences per forward/backward on one rank (when "
                                                        "max_tokens_per_micro_batch is null)")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="micro-batches cut by tokens instead of sequences: each packs sequences (prompt + "
                                "response, no padding) up to this many tokens; at least rollout.max_model_len")
    mini_batch_size: int | None = Field(None, ge=1, description="sequences (all ranks) per optimizer step of GRPO; "
                                                                 "null: one step per rollout batch")
    gradient_checkpointing: bool = False
    keep_freed_memory: bool = Field(
        True, description="CPU ranks keep the pages their tensors free for the next micro-batch (faster; the peak "
                          "then exceeds what is alive at once); false returns them at once and rank 0 keeps no "
                          "weight-sync buffers between syncs: the lowest peak, each page faulted in again")
    kernel_cache_entries: int = Field(
        64, ge=0, description="CPU ranks: compiled matmul kernels oneDNN and ideep each keep (0: their default, "
                              "1,024). Each new micro-batch length compiles its own, so a large cache grows a rank "
                              "with every length it has seen")
    compute_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="dtype of the learner's forward and backward (torch.autocast); weights, gradients and "
                               "optimizer state stay in model.dtype. bfloat16 pays off on GPUs and on CPUs with "
                               "AVX512-BF16 or AMX; without them its matmuls are emulated and far slower. auto: "
                               "bfloat16 where the learner's device multiplies it natively, else float32")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters only; null: every weight (full "
                                                      "fine-tuning)")

    @model_validator(mode="after")
    def _lora_is_not_zero3(self):
        if self.lora is not None and self.zero_stage == 3:
            raise ValueError("lora: adapters are too small to partition; use zero_stage 1 or 2 (the frozen weights "
                             "stay whole on every rank)")
        return self


class RetrievalSection(Strict):
    """The knowledge base the policy queries when the grammar has an action tag: indexed on first use (cached; rebuilt
    when corpus, encoder or settings change) and served by Retriever actors, one per shard."""
    kb: str = Field("hpo", description="chunks JSONL (id, doc_id, title, text, source), or 'hpo'")
    index_dir: str | None = Field(None, description="default: <medray cache>/indexes/<kb>-<kind>-<hash>")
    index: IndexConfig = Field(IndexConfig(kind="none"),
                               description="kind none: BM25 only (seconds to build); flat/hnsw/ivfpq encode the KB")
    encoder: str = Field("minilm", description="local HF / sentence-transformers directory, or 'minilm'")
    search: RetrievalConfig = RetrievalConfig(mode="sparse", top_k=3)
    shards: int = Field(1, ge=1)
    timeout_s: float = Field(60.0, gt=0, description="a slower search becomes an error observation")
    show: Literal["passages", "titles"] = Field("passages", description="what the policy reads of each hit: "
                                                "'[i] title: text', or '[i] title' only")
    link_options: bool = Field(False, description="mark a hit whose title is a multiple-choice option's text with "
                                                  "'(option X)': the documents linked to the candidate answers")
    passage_chars: int | None = Field(None, ge=1, description="show passages: each hit's text cut after this many "
                                                              "characters (the index holds it whole); null: whole")
    paging: bool = Field(False, description="a query the episode already searched returns the next top_k hits, "
                                            "numbered on (a search engine's next page)")
    rank_options: bool | Literal["places"] = Field(
        False, description="with link_options: hits that link no option are followed by the options as the same "
                           "search ranks them, however deep (sparse or phenotype search); true: in its order ('ranks "
                           "the options C, A'); places: in the question's order with their places ('ranks option A "
                           "2nd, option C 1st'), so the first letter read is not the search's choice")

    @model_validator(mode="after")
    def _mode_fits_the_index(self):
        if self.index.kind == "none" and self.search.mode not in ("sparse", "phenotype"):
            raise ValueError(f"search.mode {self.search.mode!r} needs a dense index; set index.kind to flat, hnsw "
                             f"or ivfpq, or search.mode to sparse")
        if self.search.mode == "phenotype" and self.kb != "hpo":
            raise ValueError(f"search.mode 'phenotype' ranks the HPO world's diseases; kb is {self.kb!r}, set it to "
                             f"'hpo' or choose another mode")
        if self.rank_options and not (self.link_options and self.search.mode in ("sparse", "phenotype")):
            raise ValueError(f"rank_options ranks the options a search links: it needs link_options true and "
                             f"search.mode sparse or phenotype (not {self.search.mode!r})")
        return self


class RewardSpec(Strict):
    name: str
    weight: float = 1.0
    args: dict = Field(default_factory=dict)


class RewardsConfig(Strict):
    components: list[RewardSpec] = Field(..., min_length=1)
    on_error: Literal["fail", "zero"] = Field("fail", description="a failed component fails the step, or scores 0")
    timeout_s: float = Field(120.0, gt=0)


class SFTConfig(Strict):
    """Supervised fine-tuning data of an `sft` stage: cross-entropy on the policy's tokens, with the same masks as RL
    (retrieved text and tool observations are never targets)."""
    data: str = Field(..., description="JSONL of demonstrations {task, segments: [{role: policy|environment, text}]}"
                                       " (python -m learners.expert writes them); 'expert': the scripted expert's "
                                       "demonstrations on data.train, written on first use under output_dir/stages/; "
                                       "or a source the recipe's plugin generates (its demonstration_sources)")
    batch_size: int = Field(32, ge=1, description="demonstrations per optimizer step")
    expert_recheck: float = Field(0.0, ge=0, le=1, description="data expert with retrieval.paging: the share of "
                                  "demonstrations in which the expert searches its query again and reads the next "
                                  "page before answering from the first (it shows how to page, never when it pays)")
    expert_unlinked: Literal["ranking", "skip", "guess"] = Field(
        "ranking", description="data expert with retrieval.rank_options, when no hit links the gold option: answer "
        "the options' ranking where it puts the gold first (ranking); trust only a linked hit and leave the task out "
        "(skip); or answer a guess, as a teacher who must answer without evidence (guess); skip and guess never "
        "demonstrate reading the ranking")
    shuffle: bool = True
    args: dict = Field(default_factory=dict, description="settings of the recipe's demonstration source")


#: Sections a stage may change, and single keys of others (a cold-start SFT stage at 10x the RL learning rate); the
#: rest (cluster, model, the learner's other keys, retrieval, ...) hold for the whole run.
STAGE_SECTIONS = ("data", "rollout", "algorithm", "rewards")
STAGE_KEYS = ("learner.lr",)
#: Keys of those sections the rollout engines are built with, once per run.
ENGINE_KEYS = ("rollout.dtype", *(f"rollout.{name}" for name in EngineSettings.model_fields))


class StageConfig(Strict):
    """One stage of a multi-stage run (e.g. RL stages with different rewards, or SFT then RL)."""
    name: str
    kind: Literal["grpo", "sft"] = "grpo"
    steps: int = Field(..., ge=1)
    sft: SFTConfig | None = None
    set: dict[str, Any] = Field(default_factory=dict,
                                description="dotted keys of data/rollout/algorithm/rewards replaced in this stage")

    @model_validator(mode="after")
    def _kind_has_data(self):
        if (self.kind == "sft") != (self.sft is not None):
            raise ValueError("an sft stage needs an sft section (and only an sft stage has one)")
        bad = [k for k in self.set
               if (k.split(".")[0] not in STAGE_SECTIONS and k not in STAGE_KEYS) or k in ENGINE_KEYS]
        if bad:
            raise ValueError(f"set: {bad} cannot change between stages; a stage may set keys of {STAGE_SECTIONS} "
                             f"(but not {ENGINE_KEYS}) and {STAGE_KEYS}")
        return self


class RunConfig(Strict):
    output_dir: str
    seed: int = 0
    total_steps: int = Field(..., ge=1)
    resume: bool = False
    async_mode: Literal["sync", "one_step_off", "fully_async"] = Field(
        "sync", alias="async", description="sync: generate, then train; one_step_off: step t+1's rollouts are "
                                           "generated while step t trains; fully_async: the rollout workers generate "
                                           "continuously and take new weights between slices, episodes in flight "
                                           "included (learners/rollout_stream.py)")
    max_staleness: int = Field(1, ge=0, description="fully_async: the most weight versions a trained group may lag "
                                                    "the learner (0: on-policy, as sync)")
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    retrieval: RetrievalSection | None = Field(None, description="needed when rollout.grammar has an action tag")
    recipe: RecipeSpec | None = Field(None, description="the recipe's plugin (recipes/): its name, or "
                                                          "{name, module, args}; none: the config alone")
    judge: JudgeConfig | None = Field(None, description="an LLM judge (JudgeActor) for judge-based rewards")
    tools: ToolsConfig | None = Field(None, description="a tool Gym the policy calls through the grammar's action tag "
                                                        "(actors/gym.py); replaces retrieval as the environment")
    algorithm: AlgorithmConfig = AlgorithmConfig()
    learner: LearnerConfig = LearnerConfig()
    rewards: RewardsConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    storage: StorageConfig = StorageConfig()
    eval: EvalConfig | None = Field(None, description="held-out evaluation during and after training")
    logging: LoggingConfig = LoggingConfig()
    stages: list[StageConfig] = Field(default_factory=list,
                                      description="empty: one GRPO stage of total_steps; else steps must sum to it")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @model_validator(mode="after")
    def _batch_divides(self):
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        ranks = self.cluster.learner.num
        if batch % ranks:
            raise ValueError(f"rollout batch {batch} (prompts_per_step x group_size) must divide over "
                             f"{ranks} learner ranks (cluster.learner.num)")
        budget = self.learner.max_tokens_per_micro_batch
        if budget is not None and budget < self.rollout.max_model_len:
            raise ValueError(f"learner.max_tokens_per_micro_batch {budget} is smaller than the longest sequence a "
                             f"rollout can make (rollout.max_model_len {self.rollout.max_model_len})")
        mini = self.learner.mini_batch_size
        if mini is not None and (batch % mini or mini % ranks):
            raise ValueError(f"learner.mini_batch_size {mini} must divide the rollout batch {batch} and split over "
                             f"{ranks} learner ranks")
        if self.algorithm.advantage != "grpo" and self.rollout.group_size < 2:
            raise ValueError(f"algorithm.advantage {self.algorithm.advantage} compares the rollouts of a prompt: it "
                             f"needs rollout.group_size >= 2")
        if self.rollout.grammar.action_tag and self.retrieval is None and self.tools is None:
            raise ValueError(f"rollout.grammar.action_tag <{self.rollout.grammar.action_tag}> needs an environment: "
                             f"add a retrieval or a tools section")
        if self.stages and sum(s.steps for s in self.stages) != self.total_steps:
            raise ValueError(f"stages last {sum(s.steps for s in self.stages)} steps in all but total_steps is "
                             f"{self.total_steps}")
        for stage in self.stages:
            if stage.sft and stage.sft.batch_size % ranks:
                raise ValueError(f"stage {stage.name!r}: sft.batch_size {stage.sft.batch_size} must divide over "
                                 f"{ranks} learner ranks")
        for stage in self.stages:
            if stage.sft and stage.sft.expert_recheck and (stage.sft.data != "expert" or self.retrieval is None
                                                           or not self.retrieval.paging):
                raise ValueError(f"stage {stage.name!r}: sft.expert_recheck needs sft.data expert and "
                                 f"retrieval.paging true (the next page is what it reads)")
            if stage.sft and stage.sft.expert_unlinked != "ranking" and (
                    stage.sft.data != "expert" or self.retrieval is None or not self.retrieval.rank_options):
                raise ValueError(f"stage {stage.name!r}: sft.expert_unlinked {stage.sft.expert_unlinked} needs "
                                 f"sft.data expert and retrieval.rank_options true (the ranking is what it leaves "
                                 f"unread)")
        recipe = load_recipe(self.recipe)
        for stage in self.stages:
            if stage.sft and stage.sft.args and stage.sft.data not in recipe.demonstration_sources:
                raise ValueError(f"stage {stage.name!r}: sft.args set the recipe's demonstration sources "
                                 f"{list(recipe.demonstration_sources)}, not sft.data {stage.sft.data!r}")
        recipe.check(self)
        if self.eval is not None and self.eval.judge and self.judge is None:
            raise ValueError("eval.judge needs a `judge` section: the JudgeActor that grades the open answers")
        if self.judge is not None and self.cluster.judge.num != 1:
            raise ValueError("cluster.judge.num must be 1: one JudgeActor serves every reward actor (by name)")
        if self.retrieval is not None and self.cluster.retriever.num != self.retrieval.shards:
            raise ValueError(f"cluster.retriever.num ({self.cluster.retriever.num}) must equal retrieval.shards "
                             f"({self.retrieval.shards}): one Retriever actor serves one shard")
        if self.async_mode == "fully_async" and (self.cluster.weight_sync == "collective" or (
                self.cluster.weight_sync == "auto" and self.cluster.learner.num_gpus > 0)):
            raise ValueError("async: fully_async needs cluster.weight_sync object_store: a collective broadcast would "
                             "make the learner wait for every worker's generation slice")
        check_budgets(self)  # turns and tokens the environment can honour (learners/budgets.py)
        return self

    def dump(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    def engine_dtype(self) -> str:
        """The dtype rollout (and evaluation) engines hold the policy's weights in."""
        if self.rollout.dtype == "auto":
            from cluster.devices import fast_bfloat16
            native = self.cluster.rollout.num_gpus > 0 or fast_bfloat16("cpu")
            return "bfloat16" if native else self.model.dtype
        return self.rollout.dtype or self.model.dtype

    def engine_args(self) -> dict:
        """RolloutWorker's keyword arguments this config fixes, the same for training and evaluation engines (built
        once per run: stages cannot change them, ENGINE_KEYS)."""
        res = self.cluster.rollout
        return {"seed": self.seed, "threads": res.threads, "tensor_parallel_size": res.tensor_parallel_size,
                "dtype": self.engine_dtype(), **self.rollout.engine_settings(),
                "grammar": self.rollout.grammar.model_dump()}

    def fidelity_tolerance(self) -> float:
        """rollout.fidelity_tolerance, or by default the looser of the ones for the learner's weights (the check's
        learner side runs in them, whatever learner.compute_dtype is) and the engine's."""
        return self.rollout.fidelity_tolerance or max(FIDELITY_TOLERANCE[self.model.dtype],
                                                      FIDELITY_TOLERANCE[self.engine_dtype()])

    def stage_plan(self) -> list[StageConfig]:
        """The run's stages; a config without any is one GRPO stage of total_steps."""
        return self.stages or [StageConfig(name="grpo", steps=self.total_steps)]

    def for_stage(self, index: int) -> "RunConfig":
        """This config as stage `index` runs it: the stage's `set` keys applied, validated again."""
        stage = self.stage_plan()[index]
        raw = self.dump()
        for key, value in stage.set.items():
            node = raw
            *parents, leaf = key.split(".")
            for part in parents:
                if not isinstance(node.get(part), dict):
                    raise ValueError(f"stages[{index}].set: {key!r}: {part!r} is not a section")
                node = node[part]
            node[leaf] = value
        return RunConfig.model_validate(raw)


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config (and the base it `extends`, learners/config_loader.py), apply `dotted.key=value` overrides,
    and validate it into a `RunConfig`."""
    config = read_config(path)
    apply_overrides(config, overrides)
    try:
        cfg = RunConfig.model_validate(config.raw)
    except ValidationError as e:
        raise config.invalid(e) from None
    for i, stage in enumerate(cfg.stages):
        try:
            cfg.for_stage(i)
        except (ValidationError, ValueError) as e:
            detail = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()) \
                if isinstance(e, ValidationError) else str(e)
            raise ConfigError(f"{config.path}: stages[{i}] ({stage.name}) set "
                              f"({config.origin(('stages', i, 'set'))}): {detail}") from None
    return cfg
