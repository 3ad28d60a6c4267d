"""The V-shape schedules (zbv, dualpipev) against literal tables and PyTorch's own generators; the V-shapes that
hold less (v_half, v_min) against literal tables and the published ratios; PyTorch's CSV schedule files read and
written (with the old-B trap refused)."""
import time

import pytest

import mpedu.core.schedules.vmem as vmem
from mpedu.core import schedules

Action, Schedule, ScheduleError = schedules.Action, schedules.Schedule, schedules.ScheduleError
from_option, make, read_csv = schedules.from_option, schedules.make, schedules.read_csv
from mpedu.predict import peak_in_flight, simulate


def v(p: int) -> list[int]:
    """The V placement: device r holds stages r and 2p-1-r."""
    return list(range(p)) + list(reversed(range(p)))


def table(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in row) for row in schedule.actions]


def unit_costs(schedule: Schedule):
    """Makespan and per-device peak of micro-batch-stages held, at F = B = W = 1 with free transfers."""
    timeline = simulate(schedule, [1.0] * schedule.num_stages, link="0s,inf")
    return timeline.makespan, list(peak_in_flight(timeline).values())


def torch_rows(order) -> tuple[list[list[Action]], set]:
    """PyTorch's per-rank order in mpedu's actions (written here apart from files.read_csv, to check it too):
    I -> B of a split backward, a full backward B -> B and its W at once, OVERLAP_F_B -> its sub-actions in
    order; and the (rank, position) of each overlapped forward."""
    rows, pairs = [], set()
    for rank, row in enumerate(order):
        out = []
        for a in row:
            if a is None:
                continue
            if a.sub_actions is not None:
                pairs.add((rank, len(out)))
            for sub in a.sub_actions or (a,):
                kind, s, i = sub.computation_type.value, sub.stage_index, sub.microbatch_index
                out += {"F": [Action("F", s, i)], "I": [Action("B", s, i)], "W": [Action("W", s, i)],
                        "B": [Action("B", s, i), Action("W", s, i)]}[kind]
        rows.append(out)
    return rows, pairs


# -- literal tables --------------------------------------------------------------------------------------

def test_zbv_two_devices_four_micro_batches():
    s = make("zbv", [0, 1, 1, 0], 4)
    assert table(s) == [
        # fill  | turn (up stage: F B W)      | steady                                 | drain
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3",
        "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3",
    ]
    assert s.split_backward == frozenset(range(4)) and s.overlapped == frozenset()
    assert unit_costs(s) == (25.0, [4.0, 4.0])


def test_dualpipev_two_devices_four_micro_batches():
    s = make("dualpipev", [0, 1, 1, 0], 4)
    assert table(s) == [
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3W1 3F2 0B0 0W0 3B2 3W2 3F3 0B1 0W1 3B3 3W3 0B2 0W2 0B3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3",
    ]
    # the overlapped pairs, (device, position of the forward): 0F3 3B1, 3F2 0B0, 3F3 0B1 | 2F2 1B0, 1F3 2B1, 2F3 1B1
    assert s.overlapped == {(0, 7), (0, 10), (0, 15), (1, 7), (1, 10), (1, 13)}
    assert all(s.actions[d][k].kind == "F" and s.actions[d][k + 1].kind == "B" for d, k in s.overlapped)
    assert unit_costs(s) == (25.0, [5.0, 5.0])


def assert_every_action_once_per_device(s, p, m):
    """Each device of a V runs F, B and W of every micro-batch on each of its two stages, once."""
    for d, row in enumerate(s.actions):
        assert len(row) == 6 * m, f"device {d}: F, B and W of m micro-batches on each of its two stages"
        for stage in (d, 2 * p - 1 - d):
            for kind in "FBW":
                assert sorted(a.mb for a in row if (a.kind, a.stage) == (kind, stage)) == list(range(m))


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 12)])
def test_v_schedules_validate_count_and_take_6m_plus_p_minus_1(name, p, m):
    s = make(name, v(p), m)               # make validates
    assert_every_action_once_per_device(s, p, m)
    makespan, peaks = unit_costs(s)
    assert makespan == 6 * m + p - 1                     # p - 1 idle ticks per device
    assert peaks == [2 * p + (name == "dualpipev")] * p   # DualPipeV holds one micro-batch-stage more


def test_zbv_with_fewer_micro_batches_than_its_v_holds_pads_like_pytorch():
    """m < 2p - 1: PyTorch's rows for 2p - 1 micro-batches with the missing ones left out; it runs, slower."""
    s = make("zbv", v(4), 4)
    assert unit_costs(s)[0] == 30.0 > 6 * 4 + 4 - 1
    assert unit_costs(make("zbv", v(2), 1))[0] == 10.0


def test_names_and_aliases():
    for name, key in [("zbv", "zbv"), ("ZBVZeroBubble", "zbv"), ("zero-bubble-v", "zbv"), ("dualpipev", "dualpipev"),
                      ("DualPipe_V", "dualpipev")]:
        assert make(name, v(2), 4).name == key


# -- refusals ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["zbv", "dualpipev", "v_half", "v_min"])
@pytest.mark.parametrize("stage_devices", [[0, 1], [0, 1, 0, 1], [0, 0, 1, 1], [0, 1, 2, 2, 1]])
def test_v_schedules_refuse_other_placements_in_words(name, stage_devices):
    with pytest.raises(ValueError, match=rf"{name} needs the V placement: 2p stages on p devices, device r holding "
                                         r"stages r and 2p-1-r .* e\.g\. stage devices \[0, 1, (2, 2, )?1, 0\]"):
        make(name, stage_devices, 8)


@pytest.mark.parametrize("p,m", [(2, 3), (4, 7), (4, 4)])
def test_dualpipev_refuses_fewer_micro_batches_than_stages(p, m):
    with pytest.raises(ValueError, match=rf"dualpipev needs at least as many micro-batches as stages: m >= 2p = "
                                         rf"{2 * p} for {p} devices, got m={m}.*Use micro_batches >= {2 * p}, or zbv"):
        make("dualpipev", v(p), m)


def test_a_bad_overlap_marker_is_refused_in_words():
    s = make("dualpipev", v(2), 4)
    s.overlapped = s.overlapped | {(0, 0)}            # 0F0 is followed by 0F1, no backward
    with pytest.raises(ScheduleError, match=r"overlapped pair \(device 0, position 0\): an overlapped pair is a "
                                            r"forward followed on its device by a backward \(B\) of another stage"):
        s.validate()


# -- V-Half and V-Min: the V-shapes that hold less ----------------------------------------------------------

def ratios(schedule: Schedule) -> tuple[float, float]:
    """Bubble and memory against 1F1B's on the same devices, at F = B = W = 1 per V stage (1F1B's stage is two V
    stages: F = 2, B = 4): 1F1B idles 6(p - 1) ticks and holds 2p micro-batch-stages (p whole micro-batches) on
    device 0; every schedule here is busy 6m ticks per device."""
    p, m = schedule.num_devices, schedule.micro_batches
    makespan, peaks = unit_costs(schedule)
    return (makespan - 6 * m) / (6 * (p - 1)), max(peaks) / (2 * p)


def test_v_half_two_devices_four_micro_batches():
    s = make("v_half", v(2), 4)
    assert table(s) == [
        "0F0 0F1 3F0 3B0 3F1 3W0 0F2 0B0 3B1 0W0 3F2 3W1 0F3 0B1 3B2 0W1 3F3 3B3 0B2 3W2 0B3 3W3 0W2 0W3",
        "1F0 2F0 1F1 2F1 2B0 1B0 2W0 1W0 1F2 2F2 2B1 1B1 2W1 1F3 1W1 2F3 2B2 1B2 2B3 1B3 2W2 1W2 2W3 1W3",
    ]
    assert s.split_backward == frozenset(range(4)) and s.overlapped == frozenset()
    assert unit_costs(s) == (25.0, [4.0, 4.0])         # on 2 devices: ZB-V's length and memory, another order


def test_v_min_two_devices_four_micro_batches():
    s = make("v_min", v(2), 4)
    assert table(s) == [
        "0F0 0F1 3F0 3B0 3W0 0B0 0W0 3F1 3B1 3W1 0F2 0B1 0W1 3F2 3B2 3W2 0F3 0B2 0W2 3F3 3B3 3W3 0B3 0W3",
        "1F0 2F0 2B0 1B0 1F1 2F1 2W0 1W0 2B1 1B1 1F2 2F2 2W1 1W1 2B2 1B2 1F3 2F3 2W2 1W2 2B3 1B3 2W3 1W3",
    ]
    assert unit_costs(s) == (27.0, [3.0, 4.0])


def test_the_blocks_and_their_gap():
    """Micro-batch 0's (F down, F up, B up, B down) ticks per device; the gap before B up is the smallest that puts
    a device's four actions on four ticks of the 6, which is sail-sg's rule (3 for V-Half on an even p, 2 for
    V-Min on a p divisible by 3, else none)."""
    assert vmem.block("v_half", 4) == [(0, 10, 14, 25), (2, 9, 16, 24), (4, 8, 18, 23), (6, 7, 20, 22)]
    assert vmem.block("v_min", 4) == [(0, 7, 8, 15), (1, 6, 9, 14), (2, 5, 10, 13), (3, 4, 11, 12)]
    for p in range(1, 17):
        assert vmem.block("v_half", p)[0][2] == 3 * p - 1 + (3 if p % 2 == 0 else 0)
        assert vmem.block("v_min", p)[0][2] == 2 * p + (2 if p % 3 == 0 else 0)


@pytest.mark.parametrize("name", ["v_half", "v_min"])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_v_half_and_v_min_validate_count_and_hold_their_limit(name, p):
    need = vmem.min_micro_batches(name, p)
    for m in (need, need + 1, 12, 16):
        s = make(name, v(p), m)                        # make validates: no deadlock
        assert_every_action_once_per_device(s, p, m)
        makespan, peaks = unit_costs(s)
        assert max(peaks) <= vmem.held_limit(name, p, m)
        # at unit costs, for every m the generator takes, on 2 to 8 devices (fitted here, checked above):
        if name == "v_half":                           # holding p // 2 + 1 micro-batches (1F1B: p)
            assert makespan == 6 * m + max(p - 1, 6 * ((p - 1) // 2) - 1)
            assert peaks == [2 * (p // 2 + 1)] * p
        else:                                          # holding (p + 1) // 3 + 1 (on 2 devices, device 0: 1.5)
            assert makespan == 6 * m + 4 * p - 5 - (p % 3 == 0)
            assert peaks == [2 * ((p + 1) // 3 + 1) - (p == 2 and d == 0) for d in range(p)]


def test_the_memory_limits_in_micro_batch_stages():
    assert [vmem.held_limit("v_half", p, 12) for p in (2, 4)] == [4, 6]
    assert [vmem.held_limit("v_min", p, 12) for p in (2, 4)] == [4, 4]


@pytest.mark.parametrize("m", [8, 10, 12])
def test_the_published_ratios_on_four_devices(m):
    """sail-sg's V-Half: 0.28 of 1F1B's bubble at 0.75x its memory; V-Min: about 0.6 at 0.5x (p = 4); ZB-V reads
    1/6 at 1x on the same scale."""
    assert ratios(make("zbv", v(4), m)) == pytest.approx((1 / 6, 1.0))
    bubble, memory = ratios(make("v_half", v(4), m))
    assert abs(bubble - 0.28) <= 0.05 and abs(memory - 0.75) <= 0.05 and (bubble, memory) == (5 / 18, 0.75)
    bubble, memory = ratios(make("v_min", v(4), m))
    assert abs(bubble - 0.6) <= 0.05 and abs(memory - 0.5) <= 0.05 and (bubble, memory) == (11 / 18, 0.5)


def test_on_two_devices_they_save_no_memory():
    """The blocks are too short on 2 devices: V-Half is ZB-V's length and memory, V-Min three times its bubble."""
    for m in (4, 8, 10, 12):
        assert ratios(make("v_half", v(2), m)) == pytest.approx((1 / 6, 1.0))
        assert ratios(make("v_min", v(2), m)) == pytest.approx((0.5, 1.0))


@pytest.mark.parametrize("name,p,m,need,tick", [("v_half", 4, 5, 6, 25), ("v_half", 2, 3, 4, 13),
                                                ("v_min", 4, 3, 4, 15), ("v_min", 2, 2, 3, 7)])
def test_v_half_and_v_min_refuse_too_few_micro_batches_in_words(name, p, m, need, tick):
    with pytest.raises(ValueError, match=rf"{name} needs at least {need} micro-batches on {p} devices, got m={m}: its "
                                         rf"block starts a micro-batch every 6 ticks, and the first one's backward "
                                         rf"comes back to stage 0 at tick {tick}.*m >= {tick} // 6 \+ 2 = {need}\)\. "
                                         rf"Use micro_batches >= {need}, or zbv"):
        make(name, v(p), m)
    assert vmem.min_micro_batches(name, p) == need
    make(name, v(p), need)


def test_v_half_and_v_min_names_and_speed():
    for name, key in [("v_half", "v_half"), ("V-Half", "v_half"), ("vhalf", "v_half"), ("v_min", "v_min"),
                      ("V-Min", "v_min")]:
        assert make(name, v(2), 4).name == key
    assert {"v_half", "v_min", "zbv", "dualpipev"} <= set(schedules.V_SHAPED)
    start = time.perf_counter()
    make("v_half", v(4), 12), make("v_min", v(4), 12)
    assert time.perf_counter() - start < 0.2           # built at once: a planner may build many


# -- PyTorch's own orders ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,theirs", [("zbv", "ZBVZeroBubble"), ("dualpipev", "DualPipeV")])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 10, 12])
def test_v_schedules_are_pytorchs_order_rank_by_rank(name, theirs, p, m):
    """The anchors: torch 2.13's ScheduleZBVZeroBubble and ScheduleDualPipeV, kinds mapped (torch I = our B)."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    try:
        order = visualizer.get_schedule_ops(theirs, p, m, num_stages_per_rank=2)
    except ValueError as e:
        assert "requires at least as many microbatches as stages" in str(e)     # torch refuses DualPipeV m < 2p
        with pytest.raises(ValueError, match="needs at least as many micro-batches as stages"):
            make(name, v(p), m)
        return
    ours = make(name, v(p), m)
    rows, pairs = torch_rows(order)
    for rank, row in enumerate(rows):
        assert [str(a) for a in row] == [str(a) for a in ours.actions[rank]], f"rank {rank}"
    assert ours.overlapped == pairs


def test_zbv_rank_0_is_the_issues_literal_order():
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    theirs = visualizer.get_schedule_ops("ZBVZeroBubble", 2, 4, num_stages_per_rank=2)[0]
    assert " ".join(map(str, theirs)) == ("0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 "
                                          "3I3 3W3 0I2 0W2 0I3 0W3")
    assert table(make("zbv", v(2), 4))[0] == " ".join(map(str, theirs)).replace("I", "B")


# -- PyTorch's CSV files -----------------------------------------------------------------------------------

def torch_schedule(cls_name: str, p: int, m: int):
    """A torch schedule object on mocked stages (as its _schedule_visualizer builds one): p ranks, 2 stages each."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from unittest import mock

    from torch.distributed.pipelining.stage import PipelineStage
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, 2 * p
    return getattr(schedules, cls_name)([stage, stage], m)


@pytest.mark.parametrize("cls_name,p,m,ours", [("ScheduleDualPipeV", 4, 10, "dualpipev"),
                                               ("ScheduleZBVZeroBubble", 2, 4, "zbv"),
                                               ("ScheduleInterleavedZeroBubble", 2, 4, None)])   # torch's ZB1P
def test_pytorchs_csv_files_round_trip(tmp_path, cls_name, p, m, ours):
    theirs = torch_schedule(cls_name, p, m)
    path = tmp_path / "theirs.csv"
    theirs._dump_csv(str(path), format="compute_only")
    read = read_csv(path)
    rows, pairs = torch_rows([theirs.pipeline_order[r] for r in range(p)])
    assert read.actions == rows and read.overlapped == pairs and read.name == "theirs"
    if ours is not None:
        made = make(ours, v(p), m)
        assert (read.actions, read.overlapped) == (made.actions, made.overlapped)
        assert read.stage_devices == made.stage_devices
    else:                                                   # ZB1P: two stages per rank dealt round-robin
        assert read.stage_devices == (0, 1, 0, 1) and read.split_backward == frozenset(range(4))
    # ours, written, read back by torch's own _load_csv
    (tmp_path / "ours.csv").write_text(read.to_csv())
    again = torch_schedule(cls_name, p, m)
    again._load_csv(str(tmp_path / "ours.csv"))
    assert torch_rows([again.pipeline_order[r] for r in range(p)]) == (rows, pairs)
    assert read_csv(read.to_csv()).actions == read.actions


def test_to_csv_writes_pytorchs_cells():
    text = make("dualpipev", v(2), 4).to_csv()
    assert text.splitlines()[0] == ("0F0,0F1,0F2,3F0,3I0,3W0,3F1,(0F3;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B,3I2,3W2,"
                                    "(3F3;0B1)OVERLAP_F_B,3I3,3W3,0I2,0W2,0I3,0W3")
    assert make("1f1b", [0, 1], 2).to_csv() == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"     # no W: a full backward
    with pytest.raises(ValueError, match="PyTorch's schedule files have no time chunks"):
        make("wavefront", [0, 1], 2, 2).to_csv()


def test_an_old_style_b_beside_its_w_is_refused_with_the_fix_named():
    """PyTorch's older files (its zb1p_2rank_2stagep_compute.csv) wrote B for what it now calls I."""
    new = make("zbv", v(2), 4).to_csv()
    old = new.replace("I", "B")
    with pytest.raises(ScheduleError, match=r"has 3B0 \(rank 0, column 4\) and also 3W0: a B is a full backward, "
                                            r"weights included.*older files wrote B for what it now calls I.*"
                                            r"read B as I: read_csv\(\.\.\., b_means_i=True\)"):
        read_csv(old)
    assert read_csv(old, b_means_i=True).actions == read_csv(new).actions == make("zbv", v(2), 4).actions


def test_a_full_backward_among_split_ones_is_b_and_its_w_at_once():
    s = read_csv("0F0,0F1,0I0,0W0,0B1\n")
    assert table(s) == ["0F0 0F1 0B0 0W0 0B1 0W1"] and s.split_backward == {0}


def test_csv_refusals_in_words(tmp_path):
    with pytest.raises(ScheduleError, match=r"rank 0, column 1: cannot read cell '1SEND_F0'; mpedu reads PyTorch's "
                                            r"compute-only form"):
        read_csv("0F0,1SEND_F0\n1F0\n")
    with pytest.raises(ScheduleError, match="has stage 0 on rank 0 and on rank 1"):
        read_csv("0F0,0B0\n0F1,0B1\n")
    with pytest.raises(ScheduleError, match="holds no actions"):
        read_csv(",,\n")
    with pytest.raises(ValueError, match="no such file"):
        read_csv("missing.csv")
    with pytest.raises(ValueError, match=r"puts the stages on devices \[0, 1, 1, 0\].*this placement gives \[0, 1\]"):
        read_csv(make("zbv", v(2), 4).to_csv(), [0, 1])


def test_schedule_option_takes_a_csv_file(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("0F0,,0B0\n,1F0,1B0\n")                 # empty cells: idle steps
    s = from_option(str(path), [0, 1])
    assert table(s) == ["0F0 0B0", "1F0 1B0"] and s.name == "mine"
