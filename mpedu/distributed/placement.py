"""Placements over ranks: the k-th distinct device label of a placement is pipeline rank k."""
from __future__ import annotations

from ..core.placement import Placement, read_groups
from ..runtime.devices import Device


def rank_placement(model, placement: str | Placement | None, world_size: int) -> Placement:
    """A Placement whose devices are ranks `rank:0` .. `rank:p-1`.

    `placement` is None (layers split evenly over the world), a string whose device
    labels name ranks by order of first appearance (vgpu0, cuda3 and rank1 are all just
    labels; the k-th distinct one is rank k), or a Placement. Every rank must get layers.
    `world_size` is the number of pipeline ranks (with data parallelism: --pipeline-devices).
    """
    if placement is None:
        if world_size > len(model.layer_names):
            raise ValueError(f"{world_size} ranks but the model has only {len(model.layer_names)} layers "
                             f"({', '.join(model.layer_names)}): a rank with no layers has nothing to do; "
                             f"run at most {len(model.layer_names)} processes or add LSTM layers (--config)")
        devices = [Device(f"rank:{k}", True) for k in range(world_size)]
        return _check_world(Placement.even(model, devices), world_size)
    if isinstance(placement, Placement):
        labels = {dev: k for k, dev in enumerate(placement.devices)}
        mapping = {name: Device(f"rank:{labels[dev]}", True) for name, dev in placement.assignment.items()}
        return _check_world(Placement.from_dict(mapping, model), world_size)
    mapping, ranks = {}, {}
    for names, label in read_groups(placement, limit=len(model.layer_names)):
        rank = ranks.setdefault(label.lower().replace(":", ""), len(ranks))   # cuda:0 and cuda0: one label
        for name in names:
            if name in mapping:
                raise ValueError(f"layer {name!r} is placed twice; give each layer one device")
            mapping[name] = Device(f"rank:{rank}", True)
    return _check_world(Placement.from_dict(mapping, model), world_size)


def _check_world(placement: Placement, world_size: int) -> Placement:
    p = len(placement.devices)
    # world_size: the ranks of one pipeline (--pipeline-devices, else every process torchrun started)
    if p > world_size:
        raise ValueError(f"the placement {placement} uses {p} devices but a pipeline has {world_size} processes: "
                         f"one process per device, so start torchrun with --nproc-per-node {p} (on one node), "
                         f"or --pipeline-devices {p} with a multiple of {p} processes, or use fewer devices")
    if p < world_size:
        raise ValueError(f"the placement {placement} uses {p} devices but a pipeline has {world_size} processes, "
                         f"so rank{'s' if world_size - p > 1 else ''} "
                         f"{', '.join(str(r) for r in range(p, world_size))} would hold no layers; start {p} "
                         f"processes (or --pipeline-devices {p}), or place layers on every rank")
    return placement
