"""Which runner a command line builds: SingleDevice for one device, else a Pipeline with its placement (the recipe's,
an even split, or the V for the V-shaped schedules), its schedule (a name or a file) and its memory cap."""
from __future__ import annotations

from pathlib import Path

from ..core.single import SingleDevice


def build_runner(model, args):
    """SingleDevice for `--devices 1` without a placement; otherwise a Pipeline."""
    from ..core.schedules import Schedule, canonical, from_option
    if args.placement is None and args.devices == 1:
        if not Path(args.schedule).is_file():
            canonical(args.schedule)    # a misspelt schedule is refused whatever runs it
        if args.chunks > 1:
            raise ValueError(f"--chunks {args.chunks} cuts a pipeline's micro-batches along time, and --devices 1 "
                             "runs no pipeline; use --devices 2 or more with --schedule wavefront, or a --placement")
        if args.memory_cap is not None:
            raise ValueError("--memory-cap applies to pipeline devices; use --devices 2 or more, or a "
                             "--placement (one device: --placement 'embed,...,decode:vgpu0')")
        if args.recompute is not None:
            raise ValueError("--recompute applies to pipeline stages; use --devices 2 or more, or a --placement")
        if args.link is not None and args.link.emulated:
            raise ValueError(f"--link {args.link.name} joins pipeline devices, and --devices 1 has no transfer; "
                             "use --devices 2 or more, or a --placement")
        return SingleDevice(model)
    from ..core.pipeline import Pipeline
    from ..core.placement import Placement
    from ..predict.capacity import cap_memory
    from ..runtime.devices import get_devices
    if args.placement is not None:
        placement = Placement.parse(args.placement, model)
    elif v_shaped(args.schedule):        # zbv, dualpipev: 2p stages, device r holding stages r and 2p-1-r
        placement = Placement.v_shape(model, get_devices(args.devices))
    else:
        placement = Placement.even(model, get_devices(args.devices))
    # a hand-written schedule file brings its own micro-batch and chunk counts (--micro-batches, if given, must agree)
    schedule = from_option(args.schedule, placement.stage_devices,
                           args.micro_batches if args.micro_batches_given else None)
    own = isinstance(schedule, Schedule)
    pipe = Pipeline(model, placement, schedule=schedule,
                    micro_batches=None if own and not args.micro_batches_given else args.micro_batches,
                    chunks=None if own and args.chunks == 1 else args.chunks, link=args.link, recompute=args.recompute)
    return cap_memory(pipe, args.memory_cap)     # checked before the first step on each batch shape


def v_shaped(schedule) -> bool:
    """A --schedule that needs the V placement (its default placement is then Placement.v_shape)."""
    from ..core.schedules import V_SHAPED, canonical
    try:
        return isinstance(schedule, str) and canonical(schedule) in V_SHAPED
    except ValueError:
        return False                      # a file, or a name the schedule check will refuse in words


def pipeline_defaults(args, recipe) -> None:
    """The recipe's micro-batches and placement where the command line gave none (see build_parser)."""
    args.micro_batches_given = args.micro_batches is not None
    if args.micro_batches is None:
        args.micro_batches = recipe.micro_batches
    if args.devices is None and args.placement is None:
        if recipe.placement is not None and not v_shaped(getattr(args, "schedule", None)):
            args.placement = recipe.placement
        else:
            args.devices = 2
