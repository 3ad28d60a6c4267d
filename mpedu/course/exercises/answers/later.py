"""The exercises of notebooks 4, 5, 7, 8 and 9: pipelining, partitioning, schedules, the wavefront, torchrun."""
from __future__ import annotations

from ....predict import simulate
from ....runtime import Link
from ..base import Check
from .common import Exercise, _choice, _device_name, _layers_by_device, _number, _numbers, _ok, _pair, _wrong


# ---- notebook 4 --------------------------------------------------------------------------------------------

def _textbook(schedule: str, p: int, m: int, chunks: int = 1):
    from ....core import schedules
    free = Link(latency_s=0.0)
    if chunks > 1:
        return simulate(schedules.make(schedule, list(range(p)), m, chunks=chunks), [1e-3] * p, link=free)
    return simulate(schedule, [1e-3] * p, micro_batches=m, link=free)


def _gpipe_bubble(value) -> Check:
    numbers = _numbers(value, "gpipe_bubble", "(the bubble for p = 4, m = 4, the fewest micro-batches under 10%), "
                       "e.g. (0.5, 12)", ("the bubble", "the micro-batches"))
    if isinstance(numbers, Check):
        return numbers
    bubble, fewest = numbers
    p, m = 4, 4
    want = _textbook("gpipe", p, m).bubble_fraction
    if 1 < bubble <= 100:
        return _wrong(f"{bubble:g}: give the bubble as a share between 0 and 1 (0.5 for half), not a percentage")
    if abs(bubble - want) > 0.005:
        if abs(bubble - (p - 1) / m) <= 0.005:
            return _wrong(f"{bubble:g} is (p - 1)/m, the papers' bubble over the useful time; this course's bubble "
                          "is the idle share of the step", "hint: (p - 1)/(m + p - 1)")
        if abs(bubble - 1 / 5) <= 0.005:
            return _wrong(f"{bubble:g} is the bubble for p = 2 devices, m = 4", "hint: with p = 4, each device "
                          "idles p - 1 = 3 forward and 3 backward slots")
        return _wrong(f"the bubble {bubble:g} is not it; the simulator's GPipe step for p = 4, m = 4 idles {want:.3f}",
                      "hint: (p - 1)/(m + p - 1)")
    need = next(k for k in range(1, 10_000) if _textbook("gpipe", p, k).bubble_fraction < 0.1 - 1e-9)
    if fewest == need:
        return _ok(f"bubble 3/7 = {want:.1%} for p = 4, m = 4; under 10% from m = {need} on "
                   f"({p - 1}/{need + p - 1} = {(p - 1) / (need + p - 1):.1%}, as the simulator says)",
                   "(p - 1)/(m + p - 1) < 0.1 gives m > 9(p - 1) = 27")
    if fewest == need - 1:
        return _wrong(f"the bubble is right; m = {fewest:g} gives {p - 1}/{fewest + p - 1:g} = 10% exactly, not under "
                      "10%", "hint: the fewest m with (p - 1)/(m + p - 1) < 0.1")
    if fewest in (30, 31):
        return _wrong(f"the bubble is right; m = {fewest:g} solves (p - 1)/m <= 0.1, the papers' ratio, not the idle "
                      "share", "hint: solve (p - 1)/(m + p - 1) < 0.1 for m")
    return _wrong(f"the bubble is right; m = {fewest:g} is not the fewest micro-batches under 10% (the simulator: "
                  f"{_textbook('gpipe', p, int(max(fewest, 1))).bubble_fraction:.1%})",
                  "hint: solve (p - 1)/(m + p - 1) < 0.1 for m")


def _speedup_at_32(value, costs, costs32, one_device, placement) -> Check:
    pair = _pair(value, "at_32", "(does the predicted speed-up grow from m = 8 to m = 32?, is the predicted step "
                 "on two devices at m = 32 faster than at m = 4?), e.g. (True, True)")
    if isinstance(pair, Check):
        return pair
    if not all(isinstance(x, bool) for x in pair):
        return _wrong(f"at_32 = {value!r}: give two answers True or False")
    speedup, step = {}, {}
    for m, c in ((8, costs[8]), (32, costs32)):
        two = simulate("gpipe", c, placement, micro_batches=m).makespan
        speedup[m] = simulate("gpipe", c, one_device, micro_batches=m).makespan / two
        step[m] = two
    step[4] = simulate("gpipe", costs[4], placement, micro_batches=4).makespan
    grows, faster = speedup[32] > speedup[8], step[32] < step[4]
    said = (f"predicted speed-up {speedup[8]:.2f}x at m = 8, {speedup[32]:.2f}x at m = 32; predicted step on two "
            f"devices {step[4] * 1e3:.0f} ms at m = 4, {step[32] * 1e3:.0f} ms at m = 32")
    if pair == (grows, faster):
        return _ok(said, "the speed-up compares with one device running the same tiny micro-batches; the step time "
                   "is what a run pays, and tiny micro-batches waste every device")
    if pair[0] != grows:
        return _wrong(f"the speed-up {'grew' if grows else 'did not grow'}: {said}",
                      "hint: the bubble shrinks with m, but the limit (total work / the slower stage's) moves with "
                      "the micro-batch size: simulate both, on one device and on two")
    return _wrong(f"the step at m = 32 is {'faster' if faster else 'slower'} than at m = 4: {said}",
                  "hint: a ratio is not a step time: compare the makespans on two devices, not the speed-ups")


# ---- notebook 5 --------------------------------------------------------------------------------------------

def _footprints(costs, placement, micro_batches) -> dict[str, int]:
    from ....core import schedules
    from ....predict import device_footprints
    gpipe = schedules.make("gpipe", placement.stage_devices, micro_batches)
    return {f.device: f.total for f in device_footprints(costs, placement, gpipe)}


def _most_memory(value, model, batch, costs, micro_batches) -> Check:
    from ....core import Placement
    from ....predict import balance_by_time
    balanced = balance_by_time(model, batch, 3, micro_batches=micro_batches, costs=costs)
    need = _footprints(costs, balanced, micro_batches)
    device = _device_name(value)
    if device not in need:
        return _wrong(f"{value!r}: the balanced 3-device split runs on {', '.join(need)}; name one of them")
    held = _layers_by_device(balanced)
    mb = {d: f"{d} ({', '.join(held[d])}) {b / 1e6:.1f} MB" for d, b in need.items()}
    top = max(need, key=need.get)
    if device == top:
        return _ok(f"{mb[top]}, the most of the balanced split {balanced}: {'; '.join(mb.values())}",
                   "every layer but the embedding keeps about as much activation per micro-batch, and the embedding's "
                   "table is large: the device with the most layers needs the most, while time balance leaves the "
                   "decoder alone")
    if "decode" in held[device]:
        alone = "leaves it alone, and alone it needs" if held[device] == ["decode"] else "gives it few neighbours, and " \
            "with few it needs"
        return _wrong(f"{mb[device]}: decode costs the most *time*, so balancing {alone} little memory; {mb[top]}", "hint: add 2 x param_bytes and M x activation_bytes per device "
                      "(costs.stages(placement))")
    even = Placement.even(model, 3)
    even_need = _footprints(costs, even, micro_batches)
    if device == max(even_need, key=even_need.get):
        return _wrong(f"{device} needs the most in the even split ({even}); in the balanced one {mb[device]}, "
                      f"{mb[top]}", "hint: the question is for balance_by_time's split")
    return _wrong(f"{mb[device]}; {mb[top]}", "hint: add 2 x param_bytes and M x activation_bytes per device")


def _memory_cap(value, model, batch, costs, micro_batches) -> Check:
    pair = _pair(value, "under_cap", "(can memory_cap=40e6 keep every device under 40 MB: True or False, how many "
                 "ms longer the predicted step is than the balanced split's), e.g. (True, 3.0)")
    if isinstance(pair, Check):
        return pair
    fits, extra = pair
    if not isinstance(fits, bool):
        return _wrong(f"{fits!r}: say whether the cap can be met with True or False")
    from ....predict import balance_by_time
    balanced = balance_by_time(model, batch, 3, micro_batches=micro_batches, costs=costs)
    step = simulate("gpipe", costs, balanced, micro_batches=micro_batches).makespan * 1e3
    try:
        capped = balance_by_time(model, batch, 3, micro_batches=micro_batches, memory_cap=40e6, costs=costs)
    except ValueError as e:
        if fits:
            return _wrong(f"no split fits: {e}")
        return _ok(f"no split fits: {e}")
    if not fits:
        return _wrong(f"balance_by_time(..., memory_cap=40e6) returns {capped}, every device within 40 MB "
                      f"({', '.join(f'{d} {b / 1e6:.1f} MB' for d, b in _footprints(costs, capped, micro_batches).items())})",
                      "hint: try it, and print the capped split's memory")
    capped_step = simulate("gpipe", costs, capped, micro_batches=micro_batches).makespan * 1e3
    want = capped_step - step
    extra = _number(extra, "the extra time")
    if isinstance(extra, Check):
        return extra
    said = f"the capped split {capped} predicts {capped_step:.1f} ms, the balanced {balanced} {step:.1f} ms"
    if abs(extra - want) <= max(0.5, 0.05 * abs(want)):
        return _ok(f"yes, at {want:.1f} ms more per step: {said}", "with the cap, the split must fit first; among the "
                   "splits that fit, it is still the fastest")
    if abs(extra - capped_step) <= max(0.5, 0.05 * capped_step):
        return _wrong(f"{extra:g} ms is the capped step itself: {said}", "hint: what it *costs* is the difference")
    if abs(extra + want) <= max(0.5, 0.05 * abs(want)):
        return _wrong(f"{extra:g} ms is upside down: the cap makes the step longer: {said}",
                      "hint: capped minus balanced")
    if abs(extra) < 1e-9:
        return _wrong(f"the cap is not free: {said}", "hint: the balanced split needs more than 40 MB on one device, "
                      "so the cap must pick another")
    return _wrong(f"{extra:g} ms is not it: {said}", "hint: simulate both splits with gpipe and M micro-batches, and "
                  "subtract")


# ---- notebook 7 --------------------------------------------------------------------------------------------

def _stage2_holds(value) -> Check:
    n = _number(value, "stage2_holds")
    if isinstance(n, Check):
        return n
    from ....predict import peak_in_flight
    held = list(peak_in_flight(_textbook("1f1b", 4, 8)).values())
    if n == held[2]:
        return _ok(f"{held[2]:g}: p - s = 4 - 2; the simulator's 1F1B (p = 4, m = 8) holds "
                   f"{' '.join(f'{h:g}' for h in held)} on stages 0-3", "its warm-up runs p - s - 1 = 1 forward, and "
                   "each steady-state forward is answered by a backward that frees one")
    if n == 1:
        return _wrong("1 is stage 2's warm-up forwards (p - s - 1); one more forward runs before its first backward "
                      "frees anything", "hint: count the micro-batches started and not yet backwarded in its list")
    if n == held[1]:
        return _wrong(f"{n:g} is stage 1's: stages count from 0", "hint: p - s, with s = 2")
    if n == 4:
        return _wrong("4 = p is the most any stage holds: stage 0's", "hint: stage s holds p - s")
    if n == 8:
        return _wrong("8 is m, what GPipe holds on every stage; 1F1B frees each micro-batch after its backward",
                      "hint: p - s")
    return _wrong(f"{n:g} is not it", "hint: read stage 2's row in the 1F1B schedule printed at the top")


def _under_10(value) -> Check:
    numbers = _numbers(value, "under_10", "(the first m of 8, 16, 32, 64 with 1F1B's bubble under 10% for p = 8, "
                       "the micro-batches GPipe holds per device at that m), e.g. (16, 16)", ("m", "what GPipe holds"))
    if isinstance(numbers, Check):
        return numbers
    m, holds = numbers
    from ....predict import peak_in_flight
    bubbles = {k: _textbook("1f1b", 8, k).bubble_fraction for k in (8, 16, 32, 64)}
    first = next(k for k, b in bubbles.items() if b < 0.1)
    gpipe = max(peak_in_flight(_textbook("gpipe", 8, first)).values())
    said = ", ".join(f"m = {k}: {b:.1%}" for k, b in bubbles.items())
    if m != first:
        return _wrong(f"from m = {m:g}? The simulator's 1F1B bubbles for p = 8: {said}",
                      "hint: the same as GPipe's, (p - 1)/(m + p - 1)")
    if holds == gpipe:
        return _ok(f"m = {first} ({bubbles[first]:.1%}); GPipe holds all {gpipe:g} micro-batches on every device, "
                   "1F1B at most p = 8", "1F1B's bubble is GPipe's; what it saves is memory")
    if holds == 8:
        return _wrong("8 = p is what 1F1B holds on its first device; GPipe runs all m forwards first",
                      "hint: GPipe holds every micro-batch until the first backward")
    if holds == gpipe * 8:
        return _wrong(f"{holds:g} is all 8 devices together; the question is per device", "hint: one device's list")
    return _wrong(f"m = {first} is right; GPipe does not hold {holds:g}", "hint: GPipe runs all m forwards before "
                  "its first backward")


# ---- notebook 8 --------------------------------------------------------------------------------------------

def _wavefront_bubble(value) -> Check:
    pair = _pair(value, "wave_bubble", "(the bubble with m = 1, with m = 2), each a share from 0 to 1")
    if isinstance(pair, Check):
        return pair
    got = [_number(x, w) for x, w in zip(pair, ("the bubble with m = 1", "the bubble with m = 2"))]
    for x in got:
        if isinstance(x, Check):
            return x
    one, two = got
    want = [_textbook("wavefront", 4, m, chunks=8).bubble_fraction for m in (1, 2)]
    if any(1 < x <= 100 for x in got):
        return _wrong(f"{value!r}: give shares between 0 and 1 (0.5 for half), not percentages")
    ok = [abs(g - w) <= 0.005 for g, w in zip(got, want)]
    if all(ok):
        return _ok(f"{want[0]:.1%} = 3/11 with m = 1 and {want[1]:.1%} = 3/19 with m = 2, as the simulator's "
                   "wavefront says", "(p - 1)/(u + p - 1) with u = m x c units of work flowing through")
    if not ok[0]:
        if abs(one - 3 / 8) <= 0.005:
            return _wrong(f"{one:g} is (p - 1)/c, the papers' ratio over the useful time",
                          "hint: the idle share of the step, (p - 1)/(c + p - 1)")
        return _wrong(f"with m = 1: {one:g}; the simulator says {want[0]:.3f}", "hint: GPipe's bubble with c in the "
                      "place of m")
    if abs(two - want[0]) <= 0.005:
        return _wrong(f"with m = 2 the bubble is not m = 1's: two micro-batches of 8 chunks are 16 units of work "
                      f"flowing through (the simulator: {want[1]:.3f})", "hint: u = m x c")
    if abs(two - 3 / 13) <= 0.005:
        return _wrong(f"{two:g} = 3/(m + c + p - 1): the units of work multiply, m x c, they do not add",
                      "hint: u = m x c")
    return _wrong(f"with m = 2: {two:g}; the simulator says {want[1]:.3f}", "hint: (p - 1)/(m c + p - 1)")


# ---- notebook 9 --------------------------------------------------------------------------------------------

def _two_nodes(value, ranks) -> Check:
    pair = _pair(value, "two_nodes", "((the rank that sends over the network, the rank that receives), does "
                 "--schedule interleaved run: True or False), e.g. ((1, 2), True)")
    if isinstance(pair, Check):
        return pair
    hand_off, runs = pair
    if not isinstance(hand_off, (tuple, list)) or len(hand_off) != 2:
        return _wrong(f"{hand_off!r}: give the hand-off as a pair of ranks, (from, to)")
    from ....core import schedules
    stage_ranks = ranks.stage_devices
    crossing = [(a, b) for a, b in zip(stage_ranks, stage_ranks[1:]) if a // 4 != b // 4]
    try:
        schedules.make("interleaved", stage_ranks, 8)
        refused = None
    except ValueError as e:
        refused = str(e).split(";")[0]
    sent = tuple(int(r) for r in hand_off)
    if sent not in crossing:
        if sent[::-1] in crossing:
            return _wrong(f"{sent}: the forward goes from rank {sent[1]} to rank {sent[0]} (its backward the other "
                          "way)", "hint: name the forward's direction")
        if sent == (0, 4):
            return _wrong("ranks 0 and 4 exchange nothing: each rank hands on only to the next one",
                          f"hint: the placement is {ranks}")
        if sent == (7, 0):
            return _wrong("nothing goes from the last rank back to the first: the loss is computed on rank 7, and "
                          "its backward goes back rank by rank", f"hint: the placement is {ranks}")
        return _wrong(f"{sent} is not a hand-off between the nodes", f"hint: the placement is {ranks}; ranks 0-3 "
                      "are one node")
    if not isinstance(runs, bool):
        return _wrong(f"{runs!r}: say whether interleaved runs with True or False")
    if runs != (refused is None):
        return _wrong(f"the hand-off {sent} is right; interleaved " + (f"is refused: {refused}" if refused else
                      "runs"), "hint: interleaved needs at least two stages per rank")
    return _ok(f"{ranks}: the hand-off from rank {crossing[0][0]} to rank {crossing[0][1]} crosses the network "
               "(activations forward, their gradients back), every other stays in a node; interleaved "
               + (f"is refused: {refused}" if refused else "runs"))


LATER: dict[str, Exercise] = {
    "04.1": Exercise("set `gpipe_bubble` to (GPipe's bubble for p = 4 and m = 4, the fewest micro-batches that keep it "
                     "under 10%)", "the bubble is (p - 1)/(m + p - 1), the idle share of the step", _gpipe_bubble),
    "04.2": _choice(
        "set `mxnet_schedule` to the letter of your answer", "which schedule lets device 0 start on the next piece "
        "of the batch while device 1 works on the previous one?", "b", {
            "a": ("The naive schedule: one batch goes through the devices in turn.",
                  "hint: in the naive schedule device 0 waits until the batch has come back; nothing starts while "
                  "device 1 works"),
            "b": ("GPipe: the batch is cut into micro-batches (the guide's sentences), and device 0 starts micro-"
                  "batch 1 as soon as it has handed micro-batch 0 on.",
                  "the overlap comes from the dependencies: 0F1 waits only for device 0 to be free"),
            "c": ("Data parallelism: each GPU holds the whole model and trains its own sentences.",
                  "hint: in the guide each GPU holds only some layers, and a sentence goes through both"),
        }),
    "04.3": Exercise("set `at_32` to (does the predicted speed-up grow from m = 8 to m = 32?, is the predicted step on "
                     "two devices faster at m = 32 than at m = 4?), each True or False",
                     "simulate GPipe with costs32 on one device and on two, and compare with m = 8 and m = 4",
                     _speedup_at_32, needs=("costs", "costs32", "one_device", "placement")),
    "05.1": Exercise("set `most_memory` to the device of the balanced 3-device split (balance_by_time) that needs the "
                     "most memory under GPipe with M micro-batches, e.g. \"vgpu:0\"",
                     "per device: 2 x param_bytes + M x activation_bytes of its stages (costs.stages(placement))",
                     _most_memory, needs=("model", "batch", "costs", "micro_batches")),
    "05.2": Exercise("set `under_cap` to (can balance_by_time(..., memory_cap=40e6) keep every device under 40 MB: "
                     "True or False, how many ms longer its predicted step is than the balanced split's)",
                     "run balance_by_time with and without memory_cap, and simulate both splits",
                     _memory_cap, needs=("model", "batch", "costs", "micro_batches")),
    "07.1": Exercise("set `stage2_holds` to the most micro-batches stage 2 holds at once in 1F1B with p = 4 (a number)",
                     "count stage 2's warm-up forwards, then what each steady-state pair does", _stage2_holds),
    "07.2": _choice(
        "set `why_same_bubble` to the letter of your answer", "where does the bubble come from, and does 1F1B "
        "change that part of the step?", "a", {
            "a": ("The bubble is the filling and the draining: the last device waits p - 1 forward slots for its first "
                  "micro-batch, the first waits p - 1 backward slots for the last gradient. 1F1B reorders the middle, "
                  "but must still fill and drain.",
                  "what 1F1B changes is memory: it frees each micro-batch after its backward"),
            "b": ("1F1B's backwards wait for forwards in between, so each device idles as long as before.",
                  "hint: in the steady state a 1F1B device is never idle; the idle slots are at the start and the "
                  "end, as in GPipe"),
            "c": ("It does shrink it on real hardware; the simulator just does not count the time freeing memory "
                  "saves.",
                  "hint: freeing memory saves no compute: the simulator's makespans are equal because the same boxes "
                  "must wait for the same fill and drain"),
        }),
    "07.3": Exercise("set `under_10` to (the first m of 8, 16, 32, 64 where 1F1B's bubble for p = 8 is under 10%, the "
                     "micro-batches GPipe holds per device at that m)",
                     "1F1B's bubble is GPipe's, (p - 1)/(m + p - 1); GPipe holds what it starts before its first "
                     "backward", _under_10),
    "07.4": _choice(
        "set `too_small` to the letter of your answer", "try it: mpedu.plan(model, batch, devices, memory_cap=int(0.9 "
        "* capped.front[-1].peak_bytes), **options)", "a", {
            "a": ("It raises a ValueError: no plan fits; it names the smallest footprint found (the front's last "
                  "plan) and suggests a larger cap, more devices, or smaller batches or shorter buckets.",
                  "the front's smallest footprint is the smallest any candidate needs, so nothing below it can fit"),
            "b": ("It returns the plan with the smallest footprint, marked x (over the cap).",
                  "hint: a plan over the cap would not run on a real device; the planner says so instead of "
                  "returning it"),
            "c": ("It switches recomputation on and returns a plan that fits.",
                  "hint: recomputation is already among the candidates: the front's smallest plan uses it"),
        }),
    "08.1": Exercise("set `wave_bubble` to (the bubble for p = 4, c = 8 with m = 1, with m = 2 micro-batches of 8 "
                     "chunks), each a share from 0 to 1", "GPipe's bubble with the units of work flowing through in "
                     "the place of m", _wavefront_bubble),
    "08.2": _choice(
        "set `bidirectional` to the letter of your answer", "what does the backward-reading direction need at time "
        "step t?", "a", {
            "a": ("Not in the same way: the direction reading backwards needs, at time t, the layer below's later time "
                  "steps, so the layer above cannot start on chunk 0 before the layer below has finished the whole "
                  "sequence.",
                  "two wavefronts running in opposite directions would be needed, meeting in the middle"),
            "b": ("Yes: each direction is an LSTM, and an LSTM needs only its previous step.",
                  "hint: for the backward-reading direction the previous step is t + 1: which chunks of the layer "
                  "below must then be done?"),
            "c": ("No: a bidirectional layer has twice the weights, too many for one stage.",
                  "hint: memory is not what stops it; what matters is which time steps each direction needs"),
        }),
    "08.3": _choice(
        "set `handed_over` to the letter of your answer", "what does stage s need from stage s - 1, and what "
        "flows only from chunk to chunk?", "a", {
            "a": ("Only the output of stage s - 1's last layer for that chunk, (T/c, B, H); the LSTM states (h, c) of "
                  "its layers stay on stage s - 1.",
                  "the states flow from chunk to chunk within a stage; between stages only the outputs cross"),
            "b": ("The output and the states (h, c) of its LSTM layers, which stage s needs to go on.",
                  "hint: stage s's layers have states of their own; stage s - 1's states are needed only by its "
                  "own next chunk"),
            "c": ("The states (h, c) only: stage s recomputes the output from them.",
                  "hint: the layer above reads the layer below's output at every time step of the chunk"),
        }),
    "09.1": _choice(
        "set `with_1f1b` to the letter of your answer", "does 1F1B change any forward's or backward's arithmetic, or "
        "only the order in which they run?", "a", {
            "a": ("The perplexities are exactly GPipe's: the same forwards and backwards, in another order, adding up "
                  "the gradients in the same order; rank 1 now alternates 1F0 1B0 1F1 1B1, rank 0 starts a backward "
                  "as soon as one arrives.",
                  "the runtime is the same; only the action lists differ"),
            "b": ("The perplexities are lower: 1F1B updates the weights after each micro-batch.",
                  "hint: the optimizer steps once per batch with either schedule; 1F1B only reorders the actions"),
            "c": ("The perplexities differ a little, because the gradients add up in another order.",
                  "hint: print both jobs' perplexities: each stage still adds its micro-batches' gradients in the "
                  "order 0, 1, 2, 3"),
        }),
    "09.2": Exercise("set `two_nodes` to ((the rank that sends over the network, the rank that receives), does "
                     "--schedule interleaved run: True or False)",
                     "print `eight`, the ranks' placement; ranks 0-3 are one node, 4-7 the other",
                     _two_nodes, needs=("ranks",)),
}
