"""The `cluster:` section of a run config: where Ray is, and what each actor role asks of it."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ActorResources(Strict):
    num: int = Field(1, ge=1, description="how many actors of this role")
    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    threads: int = Field(1, ge=1, description="torch/OpenMP threads inside each actor")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom Ray resources each actor takes, e.g. {node_rollout: 1} "
                                                    "to put the role on the nodes that offer them")


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
