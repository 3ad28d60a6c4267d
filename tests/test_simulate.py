"""The simulator reproduces the textbook pipeline figures and agrees with run_order and real placements."""
import random
import time

import pytest

from conftest import tiny_model
from mpedu.core import Placement, Schedule, make, run_order
from mpedu.predict import Costs, StageCost, fit_link, overlap_saving, peak_in_flight, simulate
from mpedu.runtime import Link

NO_LINK = Link(latency_s=0.0)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8), (8, 32), (3, 5)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_equal_stages_give_the_textbook_bubble(name, p, m):
    tl = simulate(name, [1.0] * p, micro_batches=m, link=NO_LINK)
    assert tl.source == "predicted" and tl.devices == [f"gpu:{d}" for d in range(p)]
    assert tl.makespan == pytest.approx(3 * (m + p - 1))          # F = 1, B = 2 per micro-batch
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    for d in tl.devices:
        assert tl.busy(d) == pytest.approx(3 * m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32)])
def test_1f1b_holds_fewer_micro_batches_than_gpipe(p, m):
    gpipe = peak_in_flight(simulate("gpipe", [1.0] * p, micro_batches=m))
    one_f_one_b = peak_in_flight(simulate("1f1b", [1.0] * p, micro_batches=m))
    assert list(gpipe.values()) == [m] * p
    assert list(one_f_one_b.values()) == [min(p - s, m) for s in range(p)]   # stage 0 holds p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32)])
def test_zero_bubble_h1_idles_a_third_of_1f1b(p, m):
    unit = StageCost(1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)   # F = B = W
    zb = simulate("zb1", [unit] * p, micro_batches=m, link=NO_LINK)
    ref = simulate("1f1b", [unit] * p, micro_batches=m, link=NO_LINK)
    assert ref.idle("gpu:0") == pytest.approx(3 * (p - 1))
    assert zb.idle("gpu:0") == pytest.approx(p - 1)
    assert zb.makespan == pytest.approx(3 * m + p - 1)
    assert max(peak_in_flight(zb).values()) == min(p, m)   # W frees a micro-batch later than B would


@pytest.mark.parametrize("mode,recomputed", [("all", 8), ("all-but-last", 7)])
def test_a_recomputed_micro_batch_runs_its_forward_twice(mode, recomputed):
    # F = 1, B = 2: a recomputed micro-batch's first forward (keeping nothing) costs F, and its R before the
    # backward F again; the last micro-batch under all-but-last is not recomputed
    stages = [StageCost(1.0)] * 2
    tl = simulate("gpipe", stages, micro_batches=8, link=NO_LINK, recompute=mode)
    assert all(e.duration == pytest.approx(1.0) for e in tl.compute("gpu:0") if e.kind in "FR")
    assert sum(e.kind == "R" for e in tl.compute("gpu:0")) == recomputed
    kept = simulate("gpipe", stages, micro_batches=8, link=NO_LINK)
    assert tl.busy("gpu:0") == pytest.approx(kept.busy("gpu:0") + recomputed * 1.0)


def test_the_slowest_stage_sets_the_pace():
    # steady state: one micro-batch per (F + B) of the slowest stage; a 2x slower device is the same
    tl = simulate("gpipe", [1.0, 3.0], micro_batches=8, link=NO_LINK)
    assert tl.makespan == pytest.approx(1 + 8 * 3 + 8 * 6 + 2)
    slow = simulate("gpipe", [1.0, 1.0], micro_batches=8, link=NO_LINK, speed={"gpu:1": 1 / 3})
    assert [e.duration for e in slow.compute("gpu:1")] == pytest.approx([e.duration for e in tl.compute("gpu:1")])
    assert slow.makespan == pytest.approx(tl.makespan)


def test_transfers_are_send_events_that_delay_the_receiver():
    link = Link(latency_s=0.5, bandwidth_Bps=100.0)
    stages = [StageCost(1.0, output_bytes=50), StageCost(1.0)]
    tl = simulate("naive", stages, micro_batches=1, link=link)
    sends = tl.transfers()
    assert [(e.device, e.peer, e.bytes, e.duration) for e in sends] == [
        ("gpu:0", "gpu:1", 50, pytest.approx(1.0)), ("gpu:1", "gpu:0", 50, pytest.approx(1.0))]
    assert tl.makespan == pytest.approx(1 + 1 + 1 + 2 + 1 + 2)   # F0, send, F1, B1, send, B0
    assert tl.bytes_moved == 100


def test_a_placement_names_the_devices_and_groups_layer_costs():
    model = tiny_model(num_layers=3)
    placement = Placement.parse("embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0 | decode:vgpu1", model)
    n = len(model.layer_names)
    costs = Costs(model.layer_names, [1.0] * n, [2.0] * n, [1.0] * n, [1.0] * n, [10] * n, [7] * n, [5] * n,
                  [0] * n, (9, 2))
    schedule = make("gpipe", placement.stage_devices, 4)
    tl = simulate(schedule, costs, placement)
    assert tl.devices == ["vgpu:0", "vgpu:1"]
    assert {e.peer for e in tl.transfers()} == {"vgpu:0", "vgpu:1"} and len(tl.transfers()) == 3 * 4 * 2
    for d, row in enumerate(schedule.actions):          # each device plays its list in order
        assert [e.label for e in tl.compute(tl.devices[d])] == [str(a) for a in row]
    f = {e.stage: e.duration for e in tl.compute() if e.kind == "F"}
    assert f == pytest.approx({0: 2.0, 1: 1.0, 2: 1.0, 3: 1.0})   # stage 0 holds two layers
    with pytest.raises(ValueError, match="need the placement"):
        simulate(schedule, costs)
    with pytest.raises(ValueError, match=r"built for stage devices \[0, 1\], but the placement"):
        simulate(make("gpipe", [0, 1], 4), costs, placement)
    with pytest.raises(ValueError, match="2 stage costs for a schedule with 4 stages"):
        simulate(schedule, [1.0, 1.0])


def _scan_every_device(schedule, cost, link):
    """A slow, obviously right reference: at each step start the earliest startable action."""
    done, free, pos, played = {}, [0.0] * schedule.num_devices, [0] * schedule.num_devices, []
    while len(played) < sum(len(row) for row in schedule.actions):
        best = None
        for d, row in enumerate(schedule.actions):
            if pos[d] < len(row) and all(x in done for x in schedule.dependencies(row[pos[d]])):
                a = row[pos[d]]
                ready = max([free[d]] + [end + (link(a) if src != d else 0.0)
                                         for src, end in map(done.get, schedule.dependencies(a))])
                best = min(best or (ready, d, a), (ready, d, a), key=lambda x: (x[0], x[1]))
        ready, d, a = best
        done[a] = (d, ready + cost(d, a))
        free[d], pos[d] = ready + cost(d, a), pos[d] + 1
        played.append((d, a, ready, ready + cost(d, a)))
    return played


def test_run_order_times_every_action_like_a_brute_force_scan():
    rng = random.Random(0)
    for name, stage_devices, m in [("gpipe", [0, 1, 0, 1, 2], 5), ("interleaved", [0, 1, 0, 1], 4),
                                   ("zb1", [0, 1, 2], 6), ("1f1b", [0, 1, 2, 3], 3), ("naive", [0, 1], 2),
                                   ("wavefront", [0, 1, 2], 2)]:
        schedule = make(name, stage_devices, m, chunks=3) if name == "wavefront" else make(name, stage_devices, m)
        cost = {a: rng.random() for row in schedule.actions for a in row}
        link = {a: rng.random() * 0.3 for row in schedule.actions for a in row}
        slow = _scan_every_device(schedule, lambda d, a: cost[a], lambda a: link[a])
        fast = run_order(schedule, lambda d, a: cost[a], lambda a: link[a])
        assert {a: (d, s, e) for d, a, s, e in fast} == {a: (d, s, e) for d, a, s, e in slow}, name


def test_eight_devices_and_32_micro_batches_simulate_quickly():
    schedule = make("1f1b", list(range(8)), 32)
    start = time.perf_counter()
    tl = simulate(schedule, [StageCost(1.0, output_bytes=1000)] * 8)
    assert time.perf_counter() - start < 2.0     # loose: the benchmark asks < 50 ms
    assert len(tl.compute()) == 8 * 32 * 2


def test_bad_speeds_are_refused():
    with pytest.raises(ValueError, match="speed names device 'vgpu:9'"):
        simulate("gpipe", [1.0, 1.0], micro_batches=2, speed={"vgpu:9": 2.0})
    with pytest.raises(ValueError, match="speed 0.0"):
        simulate("gpipe", [1.0, 1.0], micro_batches=2, speed=[1.0, 0.0])
    with pytest.raises(ValueError, match="needs micro_batches"):
        simulate("gpipe", [1.0, 1.0])


def test_link_fit_reads_the_wait_between_devices():
    tl = simulate("gpipe", [1.0, 1.0], micro_batches=4, link=Link(latency_s=0.25))
    assert fit_link(tl).latency_s == pytest.approx(0.25)


def test_virtual_devices_sharing_cores_take_turns():
    # 2 devices on 1 core: nothing overlaps, the step is all the work one after another
    one = simulate("gpipe", [1.0, 1.0], micro_batches=4, link=NO_LINK, cores=1)
    assert one.makespan == pytest.approx(2 * 4 * 3)
    # 4 devices on 2 cores: between one core's and four cores' worth
    four = simulate("1f1b", [1.0] * 4, micro_batches=8, link=NO_LINK)
    two = simulate("1f1b", [1.0] * 4, micro_batches=8, link=NO_LINK, cores=2)
    assert 4 * 8 * 3 / 2 <= two.makespan < 4 * 8 * 3 and two.makespan > four.makespan
    # cores to spare: the same plan as independent devices, action by action
    spare = simulate("zb1", [1.0, 2.0, 1.0], micro_batches=5, link=Link(0.1), cores=2.999)
    ref = simulate("zb1", [1.0, 2.0, 1.0], micro_batches=5, link=Link(0.1))
    assert spare.makespan > ref.makespan
    from mpedu.predict.simulator import _run_shared
    schedule = make("interleaved", [0, 1, 0, 1], 4)
    rng = random.Random(1)
    cost = {a: 0.5 + rng.random() for row in schedule.actions for a in row}
    fast = run_order(schedule, lambda d, a: cost[a], lambda a: 0.05)
    shared = _run_shared(schedule, lambda d, a: cost[a], lambda a: 0.05, cores=2)
    assert [(d, a) for d, a, _, _ in fast] == [(d, a) for d, a, _, _ in shared]
    assert [s for *_, s, _ in fast] == pytest.approx([s for *_, s, _ in shared])


def test_peak_in_flight_can_weigh_stages_in_bytes():
    tl = simulate("gpipe", [1.0, 1.0, 1.0], micro_batches=4)
    assert peak_in_flight(tl, stage_bytes=[10, 20, 30]) == {"gpu:0": 40, "gpu:1": 80, "gpu:2": 120}
    tl = simulate(make("gpipe", [0, 1, 0, 1], 3), [1.0] * 4)
    assert peak_in_flight(tl) == {"gpu:0": 6, "gpu:1": 6}    # two stages' micro-batches on each device


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_wavefront_chunks_split_the_sequence(c):
    # 2 stages, one micro-batch cut into c time chunks: the second stage starts after
    # one chunk, so the step takes (c + 1) / c stage-times each way against naive's 2
    naive = simulate("naive", [1.0, 1.0], micro_batches=1, link=NO_LINK)
    wave = simulate("wavefront", [1.0, 1.0], micro_batches=1, chunks=c, link=NO_LINK)
    assert len(wave.compute()) == 2 * 2 * c and {e.chunk for e in wave.compute()} == set(range(c))
    assert naive.makespan / wave.makespan == pytest.approx(2 * c / (c + 1))


def test_a_pipelines_own_link_is_simulated_and_a_schedules_counts_are_not_overridden():
    from mpedu.core import Pipeline
    from mpedu.core import F, Schedule
    model = tiny_model()
    costs = [StageCost(1e-3)] * 2
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", "gpipe", micro_batches=2,
                  link="5ms,1MB/s") as pipe:
        slow = simulate(pipe, costs).makespan
        assert slow == pytest.approx(simulate(pipe, costs, link=pipe.link).makespan)      # it ignored the link
        assert slow > simulate(pipe, costs, link="shared").makespan + 0.005     # 5 ms each way
    with pytest.raises(ValueError, match="micro_batches=8, but the schedule 'gpipe' was built for 2"):
        simulate(make("gpipe", [0, 1], 2), [1.0, 1.0], micro_batches=8)
    with pytest.raises(ValueError, match="is missing"):          # a hand-built schedule the Pipeline would refuse
        simulate(Schedule("mine", (0, 1), 1, [[F(0, 0)], [F(1, 0)]]), [1.0, 1.0])
    edited = make("gpipe", [0, 1], 2)                              # checked when made, then edited
    edited.actions[0].remove(edited.actions[0][-1])
    with pytest.raises(ValueError, match="is missing"):
        simulate(edited, [1.0, 1.0])


def test_costs_profiled_on_another_model_are_refused_by_simulate_and_plan():
    from conftest import make_batch
    from mpedu.core import Pipeline
    from mpedu.predict import plan
    from mpedu.predict import profile
    model, other, batch = tiny_model(), tiny_model(hidden_size=48), make_batch(T=6, B=8)
    theirs = profile(other, batch, micro_batches=2, warmup=0, repeats=1)
    assert theirs.profiled and theirs.names == model.layer_names          # the names alone cannot tell them apart
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1", "gpipe", micro_batches=2) as pipe:
        ours, mine = (4 * sum(p.numel() for p in m.layers["lstm0"].parameters()) for m in (other, model))
        with pytest.raises(ValueError, match=f"profiled on another model: its lstm0 holds {ours:,} bytes of weights, "
                                             f"this model's {mine:,}; profile this model"):
            simulate(pipe, theirs)
        assert simulate(pipe, profile(model, batch, micro_batches=2, warmup=0, repeats=1)).makespan > 0
    with pytest.raises(ValueError, match="profiled on another model"):
        plan(model, batch, 2, costs=theirs)


@pytest.mark.parametrize("field", ["output_bytes", "activation_bytes", "param_bytes"])
def test_a_stage_cost_refuses_a_negative_or_nan_size(field):
    with pytest.raises(ValueError, match=rf"a stage's {field}=-1: expected a finite number >= 0"):
        StageCost(1.0, **{field: -1})
    with pytest.raises(ValueError, match=rf"a stage's {field}=nan"):
        StageCost(1.0, **{field: float("nan")})


@pytest.mark.parametrize("call, error, words", [
    (lambda: simulate(None, [1, 1]), TypeError, "simulate's schedule: give a name such as 'gpipe', a Schedule or a "
                                                "Pipeline, got None"),
    (lambda: simulate(42, [1, 1]), TypeError, "got 42"),
    (lambda: simulate("gpipe", [None, 1], micro_batches=2), ValueError, r"costs\[0\]=None: give each stage's cost"),
    (lambda: simulate("gpipe", [[1], [2]], micro_batches=2), ValueError, r"costs\[0\]=\[1\]: give each stage's cost"),
    (lambda: simulate("gpipe", "abc", micro_batches=2), ValueError, "one cost per stage, e.g. .*; got an empty or "
                                                                    "unusable text 'abc'"),
    (lambda: simulate("gpipe", [1, 1], micro_batches=2, speed="fast"), ValueError, "speed='fast': give one number"),
    (lambda: simulate("gpipe", [1, 1], micro_batches=2, speed={"gpu:0": "x"}), ValueError, "give {device name: number}"),
    (lambda: StageCost("1"), ValueError, r"a stage's forward \(seconds\)='1': expected a finite number"),
], ids=["schedule None", "schedule a number", "a cost None", "a cost a list", "costs text", "speed text",
        "a speed text", "StageCost text"])
def test_arguments_simulate_cannot_use_are_named_with_what_they_take(call, error, words):
    with pytest.raises(error, match=words):
        call()


# -- overlapped F || B pairs (DualPipeV): overlap=True plays each as one box of max(F, B) ---------------------------
V2 = [0, 1, 1, 0]                   # the V on 2 devices: stages 0 and 3 on device 0, 1 and 2 on device 1


def pair_events(tl, schedule):
    """(device, F event, B event) of each overlapped pair of `schedule` in the timeline."""
    found = []
    for d, k in sorted(schedule.overlapped):
        boxes = {(e.kind, e.stage, e.mb, e.chunk): e for e in tl.compute(tl.devices[d])}
        f, b = (boxes[tuple(a)] for a in schedule.actions[d][k:k + 2])
        found.append((d, f, b))
    return found


def test_dualpipev_with_overlap_plays_each_pair_in_one_tick_at_unit_costs():
    s = make("dualpipev", V2, 4)
    unit = [StageCost(1.0)] * 4                                          # F = B = W = 1
    assert simulate(s, unit, link=NO_LINK).makespan == pytest.approx(25)    # 6m + p - 1: a pair takes 2 ticks
    tl = simulate(s, unit, link=NO_LINK, overlap=True)
    # by hand: device 0 runs 0F0 0F1 0F2 in [0, 3], 3F0 3B0 3W0 3F1 in [3, 7], pair 0F3||3B1 [7, 8], 3W1, pair
    # 3F2||0B0 [9, 10] (1B0 ends at 9), ... 3F3||0B1 [13, 14] (1B1 ends at 13); device 1's pairs start at 8, 10
    # and 12; the drain ends with 1B3 [19, 20], 2W3, 1W3 on device 1 and 0B3 [20, 21], 0W3 on device 0: 22
    assert tl.makespan == pytest.approx(22)
    pairs = pair_events(tl, s)
    assert [(d, f.start) for d, f, _ in pairs] == [(0, 7), (0, 9), (0, 13), (1, 8), (1, 10), (1, 12)]
    for _, f, b in pairs:        # one tick, drawn F then B, half each
        assert (f.end, b.start, b.end) == pytest.approx((f.start + 0.5, f.start + 0.5, f.start + 1))
    assert [tl.busy(d) for d in tl.devices] == pytest.approx([24 - 3, 24 - 3])    # 3 pairs a device, a tick each
    assert tl.bubble_fraction == pytest.approx(1 - 42 / 44)
    assert tuple(overlap_saving(s, unit, link=NO_LINK)) == pytest.approx((25, 22, 3 / 25))


def test_an_overlapped_pair_lasts_the_longer_of_its_two_actions():
    s = make("dualpipev", V2, 4)
    slow_b = [StageCost(1.0, backward=4.0, backward_input=3.0, backward_weight=1.0)] * 4     # F = 1, B = 3, W = 1
    tl = simulate(s, slow_b, link=NO_LINK, overlap=True)
    for _, f, b in pair_events(tl, s):
        assert b.end - f.start == pytest.approx(3)                   # max(1, 3), not 1 + 3
        assert (f.duration, b.start) == pytest.approx((0.75, f.end))  # the box shared 1 : 3
    in_turn = simulate(s, slow_b, link=NO_LINK)
    assert [in_turn.busy(d) for d in in_turn.devices] == pytest.approx([40, 40])    # 2 stages x 4 x (1 + 3 + 1)
    assert [tl.busy(d) for d in tl.devices] == pytest.approx([40 - 3, 40 - 3])      # each pair hides its F


def test_a_pair_starts_once_both_its_inputs_are_in():
    s = Schedule.from_text("""
        0F0 0F1 2F0 2B0 2F1 0B0 2B1 0B1
        1F0 1F1 1B0 1B1""", stage_devices=[0, 1, 0])
    s.overlapped = frozenset({(0, 4)})                               # 2F1 || 0B0
    costs = [StageCost(2.0, backward=1.0)] * 3                       # F = 2, B = 1
    tl = simulate(s, costs, link=NO_LINK, overlap=True)
    # by hand: device 0 is free at 7 and 1F1 (2F1's input) ends at 6, but 1B0 (0B0's) only at 8: the box is [8, 10]
    [(_, f, b)] = pair_events(tl, s)
    assert (f.start, f.end, b.start, b.end) == pytest.approx((8, 8 + 4 / 3, 8 + 4 / 3, 10))
    # in turn 2F1 runs in [7, 9] and 0B0 in [9, 10]: the waiting costs the overlap all it hid; 2B1 [10, 11],
    # 1B1 [11, 12], 0B1 [12, 13] either way
    assert tl.makespan == pytest.approx(13) and simulate(s, costs, link=NO_LINK).makespan == pytest.approx(13)


def test_overlap_with_a_link_still_sends_every_tensor_when_the_box_ends():
    s = Schedule.from_text("""
        0F0 2F0 0F1 2B0 2F1 2B1 0B0 0B1
        1F0 1F1 1B0 1B1""", stage_devices=[0, 1, 0])
    s.overlapped = frozenset({(0, 2)})                               # 0F1 || 2B0: both send to device 1
    costs, link = [StageCost(1.0, output_bytes=10)] * 3, Link(latency_s=0.5)     # F = 1, B = 2
    in_turn, tl = simulate(s, costs, link=link), simulate(s, costs, link=link, overlap=True)
    # by hand, in turn: 0F1 [4, 5] sends at 5, 2B0 [5, 7] at 7; 1F1 [5.5, 6.5], 1B0 [7.5, 9.5], 2F1 [7, 8],
    # 2B1 [8, 10], 0B0 [10, 12], 1B1 [10.5, 12.5], 0B1 [13, 15]. Overlapped: the box [4, 6] sends both at 6,
    # so 1F1 [6.5, 7.5], 1B0 [7.5, 9.5], 2F1 [8, 9], 2B1 [9, 11], 0B0 [11, 13], 1B1 [11.5, 13.5], 0B1 [14, 16]
    assert (in_turn.makespan, tl.makespan) == pytest.approx((15, 16))
    assert len(tl.transfers()) == len(in_turn.transfers()) == 8 and tl.bytes_moved == in_turn.bytes_moved == 80
    sent = {(e.stage, e.mb): (e.start, e.end) for e in tl.transfers() if e.device == "gpu:0"}
    assert sent[0, 1] + sent[2, 0] == pytest.approx((6, 6.5, 6, 6.5))
    assert tuple(overlap_saving(s, costs, link=link)) == pytest.approx((15, 16, -1 / 15))    # overlap can cost
    # DualPipeV on a slow link: the 16 transfers still go, each pair's from its box's end
    v, unit, slow = make("dualpipev", V2, 4), [StageCost(1.0, output_bytes=10)] * 4, Link(0.25, 100.0)
    tl, in_turn = simulate(v, unit, link=slow, overlap=True), simulate(v, unit, link=slow)
    assert len(tl.transfers()) == len(in_turn.transfers()) == 16 and tl.bytes_moved == in_turn.bytes_moved
    sends = {(e.stage, e.mb): e for e in tl.transfers()}
    # on the V only 0F, 1B, 2F and 3B cross devices: 0F3||3B1, 2F2||1B0 and 2F3||1B1 send both, the others neither
    sending = [(x, b.end) for _, f, b in pair_events(tl, v) for x in (f, b) if x.kind == "FBFB"[x.stage]]
    assert len(sending) == 6
    assert [sends[x.stage, x.mb].start for x, _ in sending] == pytest.approx([end for _, end in sending])
    assert tl.makespan > 22


@pytest.mark.parametrize("name,devices,m", [("1f1b", [0, 1], 4), ("zb1", [0, 1, 2], 5), ("zbv", V2, 4),
                                            ("interleaved", [0, 1, 0, 1], 4)])
def test_overlap_changes_nothing_without_pairs(name, devices, m):
    s = make(name, devices, m)
    assert not s.overlapped
    costs = [StageCost(1.0, backward_input=1.2, backward_weight=0.8, output_bytes=100)] * s.num_stages
    for link in (NO_LINK, Link(latency_s=0.1, bandwidth_Bps=1000.0)):
        assert simulate(s, costs, link=link, overlap=True).to_dict() == simulate(s, costs, link=link).to_dict()
        assert overlap_saving(s, costs, link=link).share == 0.0
