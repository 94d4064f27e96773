"""A Ray cluster over a SLURM allocation, for multi-node OpenRLHF runs (docs/cluster.md; Ray 2.55.0).

Every task of the allocation (one per node, as slurm.submit asks for ``nodes`` x 1 task) calls
:func:`on_ray_cluster`: task 0 starts the Ray head on its node, the others join it, task 0 waits until all nodes
are in and runs the payload (the OpenRLHF launcher, whose ``ray.init()`` finds the cluster through
``RAY_ADDRESS``), then writes a done file; the others leave when they see it (or when the head is gone) and every
task runs ``ray stop``. A requeued job gets a new done file (job id + SLURM_RESTART_COUNT).

The head's port is ``NSR_RAY_PORT``: unset = 6379 (Ray's default), a number, or ``auto`` = a port derived from the
job id (20000 + job id mod 20000), for sites where two jobs may share a node or 6379 is taken. Set it in the site
file's ``setup`` lines (slurm/cluster.yaml). Every node imports this package from its install (a venv on the shared
file system), not from a path.

Check the bootstrap on a site before a long run (prints the nodes and resources Ray sees):
    srun -N 2 --ntasks-per-node=1 python -m slurm.ray_cluster
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_PORT = 6379
_WAIT = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"]))
"""


class RayBootstrapError(RuntimeError):
    """The Ray cluster could not be formed within the time limit."""


def ray_port(env: dict | None = None) -> int:
    """The head port from ``NSR_RAY_PORT`` (module doc); a clear error for anything else."""
    env = os.environ if env is None else env
    value = env.get("NSR_RAY_PORT", "").strip()
    if not value:
        return DEFAULT_PORT
    if value == "auto":
        job = env.get("SLURM_JOB_ID", "0")
        return 20000 + int(job) % 20000 if job.isdigit() else DEFAULT_PORT
    if value.isdigit() and 1024 <= int(value) <= 65535:
        return int(value)
    raise RayBootstrapError(f"NSR_RAY_PORT={value!r} is not valid; allowed: unset (6379), auto, or 1024 .. 65535")


def _ray() -> str:
    exe = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    if not Path(exe).exists():
        raise RayBootstrapError("the `ray` command is not installed (pip install 'ray[default]==2.55.0')")
    return exe


def _task() -> tuple[int, int, str, str]:
    """(rank, number of tasks, head host, job tag) from SLURM's environment (submitit or srun)."""
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    world = int(os.environ.get("SLURM_NTASKS", "1"))
    nodes = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    tag = f"{os.environ.get('SLURM_JOB_ID', 'nojob')}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return rank, world, nodes[0], tag


def _reachable(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=2):
            return True
    except OSError:
        return False


def _alive_nodes(address: str) -> int:
    p = subprocess.run([sys.executable, "-c", _WAIT, address], capture_output=True, text=True, timeout=120)
    return int(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else 0


def on_ray_cluster(fn: Callable[[], Any], done_file: str | os.PathLike, timeout_s: float = 600) -> Any:
    """Run ``fn`` on task 0 once all tasks' nodes have joined one Ray cluster; other tasks return None."""
    rank, world, head, tag = _task()
    port = ray_port()
    ip = socket.gethostbyname(head)
    address = f"{ip}:{port}"
    done = Path(f"{done_file}.{tag}")
    ray = _ray()
    common = ["--disable-usage-stats", "--include-dashboard=false"] if rank == 0 else ["--disable-usage-stats"]
    deadline = time.time() + timeout_s
    try:
        if rank == 0:
            subprocess.run([ray, "start", "--head", f"--node-ip-address={ip}", f"--port={port}", *common], check=True)
            while (n := _alive_nodes(address)) < world:
                if time.time() > deadline:
                    raise RayBootstrapError(f"only {n} of {world} nodes joined the Ray head at {address}")
                time.sleep(2)
            os.environ["RAY_ADDRESS"] = address
            try:
                return fn()
            finally:
                done.parent.mkdir(parents=True, exist_ok=True)
                done.write_text(json.dumps({"time": time.time()}))
        while not _reachable(ip, port):
            if time.time() > deadline:
                raise RayBootstrapError(f"the Ray head at {address} did not come up")
            time.sleep(1)
        subprocess.run([ray, "start", f"--address={address}", *common], check=True)
        misses = 0
        while not done.exists() and misses < 3:  # leave when task 0 is done, or its head is gone
            misses = 0 if _reachable(ip, port) else misses + 1
            time.sleep(2)
        return None
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, check=False)


def cluster_summary() -> dict:
    """What the Ray cluster of ``RAY_ADDRESS`` has: alive nodes and total resources."""
    import ray

    ray.init(logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        return {
            "address": os.environ.get("RAY_ADDRESS"),
            "nodes": len(nodes),
            "hosts": sorted(n["NodeManagerAddress"] for n in nodes),
            "resources": {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")},
        }
    finally:
        ray.shutdown()


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(f"usage: srun -N NODES --ntasks-per-node=1 python -m slurm.ray_cluster\n{__doc__}")
        sys.exit(0)
    job = os.environ.get("SLURM_JOB_ID", "x")
    out = on_ray_cluster(cluster_summary, done_file=f"{os.environ.get('TMPDIR', '/tmp')}/nsr-ray-{job}")
    if out is not None:
        print(json.dumps(out))
