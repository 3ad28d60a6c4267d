"""The process group under torchrun: backend and device per rank, the watchdog, and the data x pipeline mesh."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .heartbeat import LIMIT as HEARTBEAT
from .heartbeat import Heartbeat

TIMEOUT = 600                       # seconds a rank waits for a peer before giving up

_heartbeat: Heartbeat | None = None       # this process's watchdog, started by setup()


def setup(backend: str = "auto", timeout: float = TIMEOUT, heartbeat: float = HEARTBEAT) -> tuple[int, int, torch.device]:
    """init_process_group from torchrun's environment: (rank, world size, this rank's device).

    gloo on CPU; NCCL on `cuda:LOCAL_RANK` when every process of the node has a GPU of its own
    (see `choose_backend`). `timeout` bounds every
    wait on a peer, so a rank whose peer died exits with an error instead of hanging. `heartbeat`
    (seconds, 0 for none) ends every rank, naming the silent one, once a peer stops (mpedu.distributed.heartbeat).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("mpedu.distributed runs under torchrun, which starts one process per device: "
                           "torchrun --nproc-per-node 2 -m mpedu.distributed train")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = choose_backend(backend, local_world, torch.cuda.device_count())
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    _end_with_the_launcher()
    if not dist.is_initialized():
        # the device binds NCCL's communicator to this rank's GPU at once (no guessing from the rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
    global _heartbeat
    if heartbeat and _heartbeat is None and "MASTER_ADDR" in os.environ:
        _heartbeat = Heartbeat(dist.get_rank(), dist.get_world_size(), heartbeat).start()
    return dist.get_rank(), dist.get_world_size(), device


def _end_with_the_launcher() -> None:
    """Linux: have the kernel end this worker when the process that started it (torchrun's agent) dies.
    Before the process group is up no heartbeat runs, and a worker waiting for the rendezvous store of a
    launcher killed meanwhile would wait the whole --timeout."""
    # only under torchrun (its agent sets TORCHELASTIC_RUN_ID): a process a scheduler started with RANK and
    # WORLD_SIZE of its own may well have PID 1 (tini, docker --init, a shell) as its parent
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)         # PR_SET_PDEATHSIG
        # the launcher may have died before that line (starting Python and torch takes seconds): this process
        # was then handed to init, which is no launcher (unless torchrun is itself PID 1, in a container)
        if os.getppid() == 1 and b"torch" not in Path("/proc/1/cmdline").read_bytes():
            print(f"mpedu: rank {os.environ.get('RANK')}: the torchrun that started this process has gone; "
                  "ending it", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


def stop_heartbeat() -> None:
    """Stop this process's watchdog (before the process group goes away)."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def choose_backend(backend: str, local_world: int, gpus: int) -> str:
    """"nccl" or "gloo" for `--backend auto|nccl|gloo`, the same on every rank of a node.

    The choice depends only on what all the node's ranks see alike: how many processes torchrun
    started here (LOCAL_WORLD_SIZE) and how many GPUs there are. NCCL when every process gets a GPU
    of its own, else gloo on the CPU for all. (Deciding per rank, "is there a GPU for my local
    rank", gave two processes on one GPU NCCL on rank 0 and gloo on rank 1: the first barrier hung.)
    Nodes with different GPU counts can still choose differently: pass the backend explicitly.
    """
    if backend == "auto":
        return "nccl" if 0 < local_world <= gpus else "gloo"
    if backend == "nccl" and local_world > gpus:
        fewer = f"start at most {gpus} per node (--nproc-per-node) or " if gpus else ""
        raise ValueError(f"--backend nccl gives each process its own GPU, but torchrun started {local_world} "
                           f"processes on this node and it has {gpus} GPU(s): {fewer}use --backend gloo")
    return backend


@dataclass(frozen=True)
class Mesh:
    """World ranks laid out as (replicas, pipeline devices): rank = replica * pipeline + stage rank.

    pp: this rank's pipeline group (its replica's p ranks; None: the whole world, no data
    parallelism); dp: the group of ranks that hold the same stages in every replica (None when
    there is one replica). Gradients are all-reduced over dp; activations travel within pp.
    """

    replicas: int
    pipeline: int
    replica: int            # which replica this rank belongs to
    pipeline_rank: int      # this rank's place in its pipeline (the device index of the placement)
    pp: object = None
    dp: object = None

    def global_rank(self, replica: int, pipeline_rank: int) -> int:
        return replica * self.pipeline + pipeline_rank


def mesh(pipeline_devices: int | None = None) -> Mesh:
    """Split the world into world / pipeline_devices replicas of a pipeline of pipeline_devices ranks.

    None: one pipeline over the whole world. Every rank must call it (it creates process groups)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p = world if pipeline_devices is None else pipeline_devices
    if p < 1 or world % p:
        raise ValueError(f"--pipeline-devices {p} must divide the {world} processes torchrun started: each "
                         f"replica is a pipeline of {p} ranks; start a multiple of {p} processes "
                         f"(--nproc-per-node) or pick a divisor of {world}")
    replicas = world // p
    if replicas == 1:
        return Mesh(1, p, 0, rank)
    from torch.distributed.device_mesh import init_device_mesh
    kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
    grid = init_device_mesh(kind, (replicas, p), mesh_dim_names=("dp", "pp"))
    return Mesh(replicas, p, rank // p, rank % p, pp=grid.get_group("pp"), dp=grid.get_group("dp"))
