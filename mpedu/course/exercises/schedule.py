"""Check a hand-written schedule: read it (the text form mpedu prints), validate it (the grid, with a deadlock
or a bad action marked), simulate it at textbook costs (F = 1, B = 2; B = W = 1 where the backward is split),
run it for real on virtual devices against one device, and compare it with the textbook schedule: its length,
its bubble, and the micro-batches each device holds at once."""
from __future__ import annotations

from ...core import Pipeline
from ...core.schedules import ScheduleError, make, read
from ...predict.simulator import peak_in_flight, simulate
from ...runtime import Link
from . import base
from .base import Check

TEXTBOOK = {"naive": "naive", "gpipe": "GPipe", "1f1b": "1F1B", "zb1": "zero bubble (ZB-H1)"}


def check_schedule(text: str, like: str = "1f1b", micro_batches: int = 4, devices: int = 2) -> Check:
    """Check a hand-written schedule for `devices` devices (stage d on device d) and `micro_batches`
    micro-batches against the textbook schedule `like` ("gpipe", "1f1b", "zb1" or "naive")."""
    if like not in TEXTBOOK:
        raise ValueError(f"like={like!r}: compare with one of {', '.join(TEXTBOOK)}")
    if devices not in base.PLACEMENTS:
        raise ValueError(f"devices={devices}: the exercises run the tiny model, on 1 to {max(base.PLACEMENTS)} devices")
    stage_devices, name = list(range(devices)), TEXTBOOK[like]
    if not any(line.split("#", 1)[0].strip() for line in str(text).splitlines()):
        return Check(False, ["not done yet: write your schedule between the quotes, one line of actions per device, "
                             "then run the check again"])
    try:
        yours = read(text, stage_devices, micro_batches, name="yours")
    except (ScheduleError, ValueError) as e:
        return Check(False, ["not yet: " + str(e), _hint(str(e), f"{like!r}, {stage_devices}, {micro_batches}")])
    textbook = make(like, stage_devices, micro_batches)
    lines = [f"valid: every device's actions can run in order, every micro-batch gets its "
             f"{'F, B and W' if yours.split_backward else 'F and B'} ({_counts(yours)})", yours.grid()]
    ok = True
    if textbook.split_backward and not yours.split_backward:
        lines.append(f"but {name} splits each backward into B (the input's gradient, which the stage before waits "
                     "for) and W (the weights' gradient, which can wait): write W actions too")
        ok = False
    unit, free = [1.0] * devices, Link(latency_s=0.0)        # textbook costs, and hand-offs that take no time
    mine, theirs = simulate(yours, unit, link=free), simulate(textbook, unit, link=free)
    held, held_textbook = peak_in_flight(mine), peak_in_flight(theirs)
    lines.append(f"at textbook costs ({'F = B = W = 1' if yours.split_backward else 'F = 1, B = 2'}): "
                 f"{mine.makespan:g} time units, bubble {mine.bubble_fraction:.0%}; "
                 f"{name}: {theirs.makespan:g}, bubble {theirs.bubble_fraction:.0%}")
    lines.append("micro-batches held at once, per device: yours " + _per_device(held)
                 + f"; {name}'s " + _per_device(held_textbook))
    for d, (mine_d, theirs_d) in enumerate(zip(held.values(), held_textbook.values())):
        if mine_d > theirs_d:
            ok = False
            lines.append(f"unlike {name}: holds {mine_d:g} micro-batches on device {d} where {name} holds "
                         f"{theirs_d:g} (start backwards sooner: a micro-batch is held until its "
                         f"{'W' if yours.split_backward else 'B'})")
    if mine.makespan > theirs.makespan + 1e-9:
        ok = False
        idle = ", ".join(f"device {d} idles {mine.idle(n):g} of {mine.makespan:g} ({name}: {theirs.idle(n):g} of "
                         f"{theirs.makespan:g})" for d, n in enumerate(mine.devices))
        lines.append(f"unlike {name}: {mine.makespan:g} time units where {name} takes {theirs.makespan:g}: {idle}")
    lines.append(_run_for_real(yours, devices))
    ok = ok and lines[-1].startswith("correct")
    lines.insert(0, f"matches {name}" if ok else f"valid, but not {name} yet")
    return Check(ok, lines)


def _counts(schedule) -> str:
    kinds = sorted({a.kind for row in schedule.actions for a in row}, key="FBW".index)
    per = [f"{sum(a.kind == k for a in schedule.actions[0])} {k}" for k in kinds]
    return f"device 0 runs {', '.join(per)}" + (" and so does every device" if all(
        sorted(a.kind for a in row) == sorted(a.kind for a in schedule.actions[0]) for row in schedule.actions) else "")


def _per_device(held: dict) -> str:
    return " / ".join(f"{v:g}" for v in held.values())


def _hint(message: str, textbook: str) -> str:
    if "deadlock" in message:
        return ("hint: an F needs the stage before's F of the same micro-batch; a B needs its own F and the stage "
                "after's B. Some device waits for an action that can only come after its wait.")
    if "is missing" in message:
        return ("hint: every stage runs F and B (and W, in zero bubble) for every micro-batch; a schedule that skips "
                "one trains on part of the batch, so it is not a schedule of this step.")
    if "device lines" in message:
        return "hint: write one line per device, its actions in the order it runs them, e.g. '0F0 0F1 0B0 0B1'."
    if "lives on device" in message:
        return "hint: stage d lives on device d here, so device d's line holds only actions dF.., dB.. (and dW..)."
    return f"hint: compare with mpedu.core.schedules.make({textbook}).grid()"


def _run_for_real(schedule, devices: int) -> str:
    """Train one step with the schedule on virtual devices and with one device; compare loss and gradients."""
    setup = base.Setup(width=2 * schedule.micro_batches)
    pipe = Pipeline(setup.model, base.PLACEMENTS[devices], schedule)
    try:
        loss = pipe.train_step(setup.batch).loss
    finally:
        pipe.close()
    worst = max((p.grad - setup.grads[name]).abs().max().item() for name, p in setup.model.named_parameters())
    if worst <= base.EXACT and abs(loss - setup.loss) <= base.EXACT * max(1.0, abs(setup.loss)):
        return (f"correct: run for real on {devices} virtual devices, the loss and every gradient equal one "
                f"device's (max difference {worst:.0e})")
    return f"wrong: run for real, the gradients differ from one device's by up to {worst:.1e}"
