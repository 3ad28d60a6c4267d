"""Placements over ranks: the k-th distinct device label of a placement is pipeline rank k."""
from __future__ import annotations

from ..core.placement import Placement, read_groups
from ..core.schedules import V_SHAPED, Schedule, canonical, is_v_shape
from ..runtime.devices import Device

V_SCHEDULES = V_SHAPED     # built for the V placement: 2p stages, rank r holding stages r and 2p-1-r


def wants_v(schedule) -> bool:
    """Whether a schedule (a name, or a Schedule) runs on the V placement, which is then the default placement."""
    if isinstance(schedule, Schedule):
        return is_v_shape(schedule.stage_devices)
    try:
        return isinstance(schedule, str) and canonical(schedule) in V_SCHEDULES
    except ValueError:
        return False                     # a file, or a name that the schedule check refuses in words


def rank_placement(model, placement: str | Placement | None, world_size: int, schedule=None) -> Placement:
    """A Placement whose devices are ranks `rank:0` .. `rank:p-1`.

    `placement` is None (layers split evenly over the world; for a V schedule, `schedule` zbv or dualpipev, the
    V: 2p stages, rank r holding stages r and 2p-1-r), a string whose device labels name ranks by order of first
    appearance (vgpu0, cuda3 and rank1 are all just labels; the k-th distinct one is rank k), or a Placement.
    Every rank must get layers. Two groups of a string on one rank are two stages, as in Placement.parse
    ("embed:a | lstm0:b | lstm1:b | decode:a" is the V on 2 ranks).
    `world_size` is the number of pipeline ranks (with data parallelism: --pipeline-devices).
    """
    if placement is None:
        v = wants_v(schedule)
        least = 2 * world_size if v else world_size
        if least > len(model.layer_names):
            raise ValueError(f"{world_size} ranks{' in a V (2 stages each)' if v else ''} but the model has only "
                             f"{len(model.layer_names)} layers ({', '.join(model.layer_names)}): a "
                             f"{'stage' if v else 'rank'} with no layers has nothing to do; run at most "
                             f"{len(model.layer_names) // (2 if v else 1)} processes or add LSTM layers (--config)")
        devices = [Device(f"rank:{k}", True) for k in range(world_size)]
        made = Placement.v_shape(model, devices) if v else Placement.even(model, devices)
        return _check_world(made, world_size)
    if isinstance(placement, Placement):
        labels = {dev: k for k, dev in enumerate(placement.devices)}
        mapping = {name: Device(f"rank:{labels[dev]}", True) for name, dev in placement.assignment.items()}
        return _check_world(Placement(model.layer_names, mapping, placement.cuts), world_size)
    mapping, ranks, group_of = {}, {}, {}
    for k, (names, label) in enumerate(read_groups(placement, limit=len(model.layer_names))):
        rank = ranks.setdefault(label.lower().replace(":", ""), len(ranks))   # cuda:0 and cuda0: one label
        for name in names:
            if name in mapping:
                raise ValueError(f"layer {name!r} is placed twice; give each layer one device")
            mapping[name], group_of[name] = Device(f"rank:{rank}", True), k
    made = Placement.from_dict(mapping, model)
    # a layer whose neighbour before it sits on its rank in another group starts a stage of its own
    names = model.layer_names
    cuts = [b for a, b in zip(names, names[1:])
            if a in group_of and b in group_of and group_of[a] != group_of[b] and mapping[a] == mapping[b]]
    return _check_world(Placement(names, mapping, cuts) if cuts else made, world_size)


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
