"""Multi-host start-up: `jax.distributed.initialize` from a DistributedConfig, its gaps filled from the
environment (read here, at start-up, and nowhere else).

| field (and flag)                            | else                         | else (LeaderWorkerSet pod)    |
|---------------------------------------------|------------------------------|-------------------------------|
| coordinator_address (--coordinator-address) | JAXSERVE_COORDINATOR_ADDRESS | LWS_LEADER_ADDRESS, port 8476 |
| num_processes (--num-processes)             | JAXSERVE_NUM_PROCESSES       | LWS_GROUP_SIZE                |
| process_id (--process-id)                   | JAXSERVE_PROCESS_ID          | LWS_WORKER_INDEX              |

One process per host; process 0 (the leader) serves, the others follow its steps (lockstep.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from jaxserve.config import DistributedConfig
from jaxserve.errors import JaxserveError

log = logging.getLogger(__name__)

LWS_COORDINATOR_PORT = 8476


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)  # type: ignore[arg-type]
    except ValueError:
        raise JaxserveError(f"environment variable {name}={value!r} must be an integer") from None


def resolve(cfg: DistributedConfig, env: Mapping[str, str]) -> DistributedConfig:
    """`cfg` with every unset field taken from `env` (see the module table)."""
    lws_leader = env.get("LWS_LEADER_ADDRESS")
    address = cfg.coordinator_address or env.get("JAXSERVE_COORDINATOR_ADDRESS") or (
        f"{lws_leader}:{LWS_COORDINATOR_PORT}" if lws_leader else None)
    num = cfg.num_processes if cfg.num_processes is not None else _int(env, "JAXSERVE_NUM_PROCESSES")
    num = num if num is not None else _int(env, "LWS_GROUP_SIZE")
    pid = cfg.process_id if cfg.process_id is not None else _int(env, "JAXSERVE_PROCESS_ID")
    pid = pid if pid is not None else _int(env, "LWS_WORKER_INDEX")
    return dataclasses.replace(cfg, coordinator_address=address, num_processes=num, process_id=pid)


def initialize(cfg: DistributedConfig, env: Mapping[str, str]) -> bool:
    """Joins the process group when it has more than one process; False (and nothing done) otherwise.
    Must run before anything asks JAX for its devices."""
    cfg = resolve(cfg, env)
    if cfg.num_processes in (None, 1):
        return False
    missing = [name for name in ("coordinator_address", "process_id") if getattr(cfg, name) is None]
    if missing:
        raise JaxserveError(f"num_processes={cfg.num_processes} also needs {' and '.join(missing)} (flags "
                            f"--coordinator-address/--process-id, or JAXSERVE_COORDINATOR_ADDRESS/JAXSERVE_PROCESS_ID)")
    import jax

    log.info("joining %s as process %d of %d", cfg.coordinator_address, cfg.process_id, cfg.num_processes)
    jax.distributed.initialize(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id, initialization_timeout=cfg.initialization_timeout_s)
    return True
