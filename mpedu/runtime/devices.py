"""Devices: a real `cuda:N`, or a virtual `vgpu:N` that is one CPU worker thread."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    """A place where a stage runs.

    `vgpu:N` devices share the CPU's memory; each runs its ops single-threaded on
    its own worker thread, so k virtual devices on k cores really run at once.
    """

    name: str            # "vgpu:0", "cuda:1", "cpu"
    virtual: bool

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.virtual or self.name == "cpu" else torch.device(self.name)

    @property
    def is_cuda(self) -> bool:
        # read from the name: a step asks it of every device, and making a torch.device costs a torch call
        return not self.virtual and self.name.split(":")[0] == "cuda"

    def __str__(self) -> str:
        return self.name

def usable_cores() -> list[int]:
    """The CPU cores this process may run on (a container or `taskset` may allow fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))

def virtual_count() -> int:
    """Virtual devices on offer: one per CPU core, and at least 8 so a learner can try deeper
    pipelines anywhere (beyond the core count they take turns on the cores)."""
    return max(8, len(usable_cores()))

def list_devices() -> list[Device]:
    """Every device this machine offers: real CUDA GPUs first, then virtual ones."""
    real = [Device(f"cuda:{i}", False) for i in range(torch.cuda.device_count())]
    return real + [Device(f"vgpu:{i}", True) for i in range(virtual_count())]

def describe_devices() -> str:
    """A few lines a learner can read: which devices are real and which are virtual."""
    lines, cores = [], len(usable_cores())
    for d in list_devices():
        if d.virtual:
            index = int(d.name.split(":")[1])
            share = "its own core" if index < cores else "shares a core with another"
            lines.append(f"{d.name:>8}  virtual: one worker thread on the CPU ({share}; {cores} "
                         f"core{'s' if cores > 1 else ''})")
        else:
            lines.append(f"{d.name:>8}  real: {torch.cuda.get_device_name(d.torch_device)}")
    return "\n".join(lines)

def get_device(name: str | Device) -> Device:
    """Look a device up by name (`vgpu0` is accepted for `vgpu:0`)."""
    if isinstance(name, Device):
        return name
    text = str(name).strip().lower()
    if text == "cpu":
        return Device("cpu", False)
    if text[:4] in ("vgpu", "cuda") and text[4:5] != ":":
        text = f"{text[:4]}:{text[4:]}"
    for d in list_devices():
        if d.name == text:
            return d
    offered = ", ".join(d.name for d in list_devices())
    hint = "" if torch.cuda.is_available() else " (no CUDA GPU here: use virtual devices vgpu:N)"
    raise ValueError(f"device {name!r} does not exist; this machine offers {offered}{hint}")

def get_devices(n: int, kind: str = "auto") -> list[Device]:
    """The first n devices of a kind: "cuda", "virtual", or "auto" (CUDA when it has n GPUs)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"need at least one device, got {n!r}")
    cuda = [d for d in list_devices() if not d.virtual]
    virtual = [d for d in list_devices() if d.virtual]
    if kind == "auto":
        kind = "cuda" if len(cuda) >= n else "virtual"
    pool = {"cuda": cuda, "virtual": virtual}.get(kind)
    if pool is None:
        raise ValueError(f"unknown device kind {kind!r}; use 'auto', 'cuda' or 'virtual'")
    if len(pool) < n:
        raise ValueError(f"asked for {n} {kind} devices but this machine has {len(pool)}: "
                         f"{', '.join(d.name for d in pool) or 'none'}")
    return pool[:n]

def device_list(devices) -> list[Device]:
    """Devices from a count (the first n: get_devices), one name, or a list of names or Devices,
    each once."""
    if isinstance(devices, int) and not isinstance(devices, bool):
        return get_devices(devices)
    if isinstance(devices, (str, Device)):
        devices = [devices]
    try:
        devs = [get_device(d) for d in devices]
    except TypeError:
        raise TypeError(f"devices={devices!r}: give a count, e.g. 2, or names, e.g. ['vgpu:0', 'vgpu:1']") from None
    if not devs:
        raise ValueError("devices=[] names no device: give a count, e.g. 2, or names, e.g. ['vgpu:0', 'vgpu:1']")
    twice = sorted({d.name for d in devs if devs.count(d) > 1})
    if twice:
        raise ValueError(f"devices {[d.name for d in devs]} name {', '.join(twice)} twice; give each device once")
    return devs
