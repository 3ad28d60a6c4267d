"""docs/summary.md's formulas are the simulator's: bubble, activations held and transfers per cut, per schedule."""
import re
from pathlib import Path

import pytest

from conftest import make_batch, tiny_model
import mpedu.core.schedules.vmem as vmem
from mpedu.core import Pipeline, schedules
from mpedu.runtime import Link
from mpedu.predict import peak_in_flight, simulate

SUMMARY = Path(__file__).resolve().parents[1] / "docs" / "summary.md"
FREE = Link(latency_s=0.0)      # textbook: transfers take no time

# Per schedule: the formulas as docs/summary.md writes them (its table's code spans) and the same in Python.
# bubble(p, m, v, c); held(p, m, v, c, d) in micro-batches on device d; transfers per cut per step (p, m, v, c).
FORMULAS = {
    "naive": ("(p-1)/p", lambda p, m, v, c: (p - 1) / p,
              "1", lambda p, m, v, c, d: 1,
              "2*m", lambda p, m, v, c: 2 * m),
    "gpipe": ("(p-1)/(m+p-1)", lambda p, m, v, c: (p - 1) / (m + p - 1),
              "m", lambda p, m, v, c, d: m,
              "2*m", lambda p, m, v, c: 2 * m),
    "1f1b": ("(p-1)/(m+p-1)", lambda p, m, v, c: (p - 1) / (m + p - 1),
             "min(p-d, m)", lambda p, m, v, c, d: min(p - d, m),
             "2*m", lambda p, m, v, c: 2 * m),
    "interleaved": ("(p-1)/(v*m+p-1)", lambda p, m, v, c: (p - 1) / (v * m + p - 1),
                    "min(v*m, (v-1)*p + 2*(p-d-1) + 1)/v", lambda p, m, v, c, d: min(v * m, (v - 1) * p + 2 * (p - d - 1) + 1) / v,
                    "2*m", lambda p, m, v, c: 2 * m),
    "zb1": ("(p-1)/(3*m+p-1)", lambda p, m, v, c: (p - 1) / (3 * m + p - 1),
            "min(p, m)", lambda p, m, v, c, d: min(p, m),
            "2*m", lambda p, m, v, c: 2 * m),
    "wavefront": ("(p-1)/(m*c+p-1)", lambda p, m, v, c: (p - 1) / (m * c + p - 1),
                  "m", lambda p, m, v, c, d: m,
                  "2*m*c", lambda p, m, v, c: 2 * m * c),
    "zbv": ("(p-1)/(6*m+p-1)", lambda p, m, v, c: (p - 1) / (6 * m + p - 1),
            "p", lambda p, m, v, c, d: p,
            "2*m", lambda p, m, v, c: 2 * m),
    "dualpipev": ("(p-1)/(6*m+p-1)", lambda p, m, v, c: (p - 1) / (6 * m + p - 1),
                  "p+1/2", lambda p, m, v, c, d: p + 1 / 2,
                  "2*m", lambda p, m, v, c: 2 * m),
    # V-Half and V-Min: the idle ticks e beyond 6m (per V stage: F, B and W of one unit each), as the summary writes
    # them, "e/(6*m+e)" and then e itself
    "v_half": ("e/(6*m+e)", lambda p, m, v, c: _idle(p, m, max(p - 1, 6 * ((p - 1) // 2) - 1)),
               "p//2+1", lambda p, m, v, c, d: p // 2 + 1,
               "2*m", lambda p, m, v, c: 2 * m, "max(p-1, 6*((p-1)//2)-1)"),
    "v_min": ("e/(6*m+e)", lambda p, m, v, c: _idle(p, m, 4 * p - 5 - (p % 3 == 0)),
              "(p+1)//3+1-(p==2)*(d==0)/2", lambda p, m, v, c, d: (p + 1) // 3 + 1 - (p == 2) * (d == 0) / 2,
              "2*m", lambda p, m, v, c: 2 * m, "4*p-5-(p%3==0)"),
}
V_SHAPED = ("zbv", "dualpipev", "v_half", "v_min")


def _idle(p, m, e):
    return e / (6 * m + e)


def table_rows() -> dict[str, list[list[str]]]:
    """The summary's formula table: {schedule name: [code spans of each column]}."""
    rows = {}
    for line in SUMMARY.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 5 and cells[0] != "schedule":      # not the header
            spans = [re.findall(r"`([^`]+)`", cell) for cell in cells]
            if spans[1]:
                rows[spans[1][0]] = spans
    return rows


def test_the_summary_table_writes_the_formulas_this_test_checks():
    rows = table_rows()
    assert set(rows) == set(FORMULAS), f"schedules in docs/summary.md's table: {sorted(rows)}"
    for name, (bubble, _, held, _, transfers, _, *idle) in FORMULAS.items():
        _, _, bubble_col, held_col, transfers_col = rows[name]
        assert bubble_col == [bubble, *idle], f"{name}: the summary's bubble {bubble_col} is not {bubble!r} {idle}"
        assert held_col == [held], f"{name}: the summary's activations {held_col} are not {held!r}"
        assert transfers_col == [transfers], f"{name}: the summary's transfers {transfers_col} are not {transfers!r}"


def _simulated(name, p, m, v, c):
    """The textbook step of schedule `name`: stage costs F = 1, B + W = 2 per device's worth of layers."""
    if name == "interleaved":
        schedule = schedules.make(name, [s % p for s in range(v * p)], m)
        per_stage = 1 / v                                  # a device's layers cut into v stages
    elif name == "wavefront":
        schedule, per_stage = schedules.make(name, list(range(p)), m, chunks=c), 1 / c
    elif name in V_SHAPED:                                 # 2p stages, half a device's layers each
        schedule, per_stage = schedules.make(name, list(range(p)) + list(reversed(range(p))), m), 1 / 2
    else:
        schedule, per_stage = schedules.make(name, list(range(p)), m), 1.0
    n = schedule.num_stages
    timeline = simulate(schedule, [1.0 if name not in ("interleaved", *V_SHAPED) else per_stage] * n, link=FREE)
    held = peak_in_flight(timeline, stage_bytes=[per_stage] * n)     # micro-batches: a chunk counts 1/c
    cuts = n - 2 if name in V_SHAPED else n - 1                      # a V's middle hand-off crosses no device
    return timeline, [held[device] for device in timeline.devices], len(timeline.transfers()) / cuts


def _cases():
    # v stages per device (interleaved) and c time chunks (wavefront) at two sizes; the others ignore v and c.
    for name in FORMULAS:
        for p in (2, 3, 4, 8):
            for m in (1, 2, 3, 4, 8, 12, 32):
                if ((name == "interleaved" and m % p) or (name == "zb1" and m < p)
                        or (name in ("zbv", "dualpipev") and m < 2 * p)
                        or (name in ("v_half", "v_min") and m < vmem.min_micro_batches(name, p))):
                    continue                               # refused, or outside the formula (see the summary)
                for v, c in ((2, 2), (3, 4)) if name in ("interleaved", "wavefront") else ((1, 1),):
                    yield name, p, m, v, c


CASES = list(_cases())


@pytest.mark.parametrize("name,p,m,v,c", CASES)
def test_each_formula_matches_the_simulator(name, p, m, v, c):
    _, bubble, _, held, _, transfers, *_ = FORMULAS[name]
    timeline, peaks, per_cut = _simulated(name, p, m, v, c)
    assert timeline.bubble_fraction == pytest.approx(bubble(p, m, v, c)), f"{name} bubble, p={p} m={m}"
    assert peaks == pytest.approx([held(p, m, v, c, d) for d in range(p)]), f"{name} activations, p={p} m={m}"
    assert per_cut == transfers(p, m, v, c), f"{name} transfers per cut, p={p} m={m}"


def test_zero_bubble_with_fewer_micro_batches_than_devices_is_above_the_formula():
    # The summary says so: the delayed W cannot fill every gap when m < p.
    timeline, _, _ = _simulated("zb1", 4, 2, 1, 1)
    assert timeline.bubble_fraction > FORMULAS["zb1"][1](4, 2, 1, 1)


def test_naive_bubble_does_not_depend_on_balance():
    # A chain: however unequal the stages, the busy times add up to the step.
    timeline = simulate("naive", [1.0, 5.0, 0.5], micro_batches=3, link=FREE)
    assert timeline.bubble_fraction == pytest.approx(2 / 3)


def test_zbv_below_2p_micro_batches_is_above_the_formula_and_reads_the_fill_as_the_summary_says():
    # ZB-V pads to 2p - 1 micro-batches as PyTorch does: with fewer it idles longer than the formula
    timeline, _, _ = _simulated("zbv", 4, 4, 1, 1)
    assert timeline.bubble_fraction > FORMULAS["zbv"][1](4, 4, 1, 1)
    # every device idles p - 1 ticks of 6m + p - 1 at unit costs per V stage
    v = [0, 1, 2, 3, 3, 2, 1, 0]
    unit = simulate(schedules.make("zbv", v, 8), [1.0] * 8, link=FREE)
    assert unit.makespan == 6 * 8 + 4 - 1 and all(unit.idle(d) == 4 - 1 for d in unit.devices)


def test_the_two_bubble_definitions_convert_as_the_summary_says():
    text = SUMMARY.read_text()
    assert "`r/(1+r)`" in text and "`r = (p-1)/m`" in text
    for p, m in [(2, 4), (4, 8), (8, 32)]:
        r = (p - 1) / m                                    # bubble time over useful time
        idle_share = simulate("gpipe", [1.0] * p, micro_batches=m, link=FREE).bubble_fraction
        assert idle_share == pytest.approx(r / (1 + r))


@pytest.mark.parametrize("schedule,m,chunks", [("gpipe", 2, 1), ("1f1b", 4, 1), ("wavefront", 1, 3)])
def test_bytes_per_cut_per_step_are_2_T_B_H_4_whatever_m_and_c(schedule, m, chunks):
    model, batch = tiny_model(num_layers=2), make_batch(T=9, B=8)
    T, B = batch.inputs.shape
    H = model.config.hidden_size                           # what lstm0 hands to lstm1: (T, b, H)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", schedule, micro_batches=m, chunks=chunks) as pipe:
        timeline = pipe.train_step(batch).timeline
    assert timeline.bytes_moved == 2 * T * B * H * 4       # one cut: activations forward, gradients back
    assert len(timeline.transfers()) == 2 * m * chunks
