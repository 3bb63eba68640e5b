"""The `cluster:` section of a run config: where Ray is, and what each actor role asks of it."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.schema import Strict


class ActorResources(Strict):
    """What one actor of a role asks for. A vLLM engine (rollout, judge) may shard its model over
    `tensor_parallel_size` worker processes: num_cpus, num_gpus and threads are then per shard, and the actor's bundle
    holds tensor_parallel_size times num_cpus and num_gpus (custom resources stay per actor)."""
    num: int = Field(1, ge=1, description="how many actors of this role")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per actor (per shard with tensor_parallel_size > 1)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor (per shard with tensor_parallel_size > 1)")
    threads: int = Field(1, ge=1, description="torch/OpenMP threads inside each actor (each shard's worker process)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM engines (rollout, judge): shards of the model, one "
                                                           "worker process each")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom Ray resources each actor takes, e.g. {node_rollout: 1} "
                                                    "to put the role on the nodes that offer them")

    @model_validator(mode="after")
    def _whole_gpu_per_shard(self):
        if self.tensor_parallel_size > 1 and self.num_gpus not in (0, 1):
            raise ValueError(f"num_gpus: {self.num_gpus:g} per shard with tensor_parallel_size "
                             f"{self.tensor_parallel_size}; a sharded engine takes one whole GPU per shard (num_gpus: "
                             f"1) or none (num_gpus: 0, on CPU)")
        return self

    @property
    def actor_cpus(self) -> float:
        """CPUs of one actor's bundle: every shard's."""
        return self.num_cpus * self.tensor_parallel_size

    @property
    def actor_gpus(self) -> float:
        """GPUs of one actor's bundle: every shard's."""
        return self.num_gpus * self.tensor_parallel_size


class ClusterConfig(Strict):
    address: str | None = Field(None, description="Ray address to join; default: RAY_ADDRESS, else start a local Ray")
    host: str = Field("127.0.0.1", description="interface a locally started Ray binds to")
    num_cpus: int | None = Field(None, description="CPUs a locally started Ray offers (default: all)")
    include_dashboard: bool = False
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK"] = "PACK"
    autoscale: bool = Field(False, description="the cluster adds nodes on demand (ray up with an autoscaler): ask for "
                                                "the run's bundles and wait for them instead of refusing a layout "
                                                "larger than the nodes up now")
    placement_timeout_s: float = Field(1200.0, gt=0, description="how long to wait for every role's bundles (a GPU "
                                                                  "node's boot and set-up included)")
    rollout: ActorResources = ActorResources(threads=2)
    learner: ActorResources = ActorResources(num=2, num_cpus=0.25)
    reward: ActorResources = ActorResources(num_cpus=0.25)
    retriever: ActorResources = Field(ActorResources(num_cpus=0.25),
                                      description="one Retriever actor per index shard (num = retrieval.shards)")
    judge: ActorResources = Field(ActorResources(num_cpus=0.25), description="the JudgeActor (judge section); num 1")
    weight_sync: Literal["auto", "object_store", "collective"] = Field(
        "auto", description="learner -> rollout transport; auto: collective (NCCL) with GPUs, else the object store")
    sync_bucket_mb: float = Field(256.0, gt=0, description="object-store bucket size: bounds peak extra memory")

    @model_validator(mode="after")
    def _only_engines_shard(self):
        for role in ("learner", "reward", "retriever"):
            if getattr(self, role).tensor_parallel_size > 1:
                raise ValueError(f"cluster.{role}.tensor_parallel_size: only vLLM engines (cluster.rollout, "
                                 f"cluster.judge) shard by tensor parallelism")
        return self
