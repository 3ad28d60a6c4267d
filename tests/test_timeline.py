"""Timeline arithmetic: makespan, busy and idle time, bubble fraction, text and JSON."""
import dataclasses

import pytest

from mpedu.core import Event, Timeline


def two_device_gpipe():
    # vgpu:0: F0 [0,1) F1 [1,2) .......... B0 [5,7) B1 [7,9)   busy 6 of 9
    # vgpu:1:        F0 [1,2) F1 [2,3) B0 [3,5) B1 [5,7)   busy 6 of 9
    t = Timeline(["vgpu:0", "vgpu:1"])
    for e in [Event("vgpu:0", "F", 0, 0, 0.0, 1.0), Event("vgpu:0", "F", 0, 1, 1.0, 2.0),
              Event("vgpu:0", "send", 0, 0, 1.0, 1.0, bytes=100, peer="vgpu:1"),
              Event("vgpu:1", "F", 1, 0, 1.0, 2.0), Event("vgpu:1", "F", 1, 1, 2.0, 3.0),
              Event("vgpu:1", "B", 1, 0, 3.0, 5.0), Event("vgpu:1", "B", 1, 1, 5.0, 7.0),
              Event("vgpu:0", "B", 0, 0, 5.0, 7.0), Event("vgpu:0", "B", 0, 1, 7.0, 9.0)]:
        t.add(e)
    return t


def test_derived_figures():
    t = two_device_gpipe()
    assert t.makespan == 9.0
    assert t.busy("vgpu:0") == 6.0 and t.busy("vgpu:1") == 6.0
    assert t.idle("vgpu:0") == 3.0
    assert t.bubble_fraction == pytest.approx(1 - 12 / 18)
    assert t.bytes_moved == 100 and len(t.transfers()) == 1
    assert [e.label for e in t.compute("vgpu:1")] == ["1F0", "1F1", "1B0", "1B1"]


def test_summary_and_round_trip():
    t = two_device_gpipe()
    text = t.summary()
    assert "makespan 9000.0 ms, bubble 33.3%" in text
    assert "vgpu:0: busy   6000.0 ms (67%)  0F0 0F1 0B0 0B1" in text
    assert Timeline.from_dict(t.to_dict()).events == t.events
    chunked = Timeline(t.devices, [dataclasses.replace(e, chunk=k % 2) for k, e in enumerate(t.events)])
    assert "0F0.0 0F1.1" in chunked.summary()        # with chunks, chunk 0 is written too, as a schedule writes it


def test_from_dict_names_an_event_it_cannot_place():
    d = two_device_gpipe().to_dict()
    d["events"][2]["device"] = "vgpu:7"
    with pytest.raises(ValueError, match=r"event 2 is on device 'vgpu:7', which the timeline's devices"):
        Timeline.from_dict(d)
    d = two_device_gpipe().to_dict()
    d["events"][0]["colour"] = "red"
    with pytest.raises(ValueError, match=r"event 0 of the timeline is not an Event.*fields: device, kind"):
        Timeline.from_dict(d)
    d = two_device_gpipe().to_dict()
    del d["events"][1]["end"]
    with pytest.raises(ValueError, match=r"event 1 of the timeline is not an Event: .*'end'"):
        Timeline.from_dict(d)
    d = two_device_gpipe().to_dict()
    d["events"][0]["peer"] = "rank:1"            # a receiver on another process (torchrun) is kept
    assert Timeline.from_dict(d).chrome_trace()["traceEvents"]


def test_empty_timeline_has_no_bubble():
    assert Timeline(["vgpu:0"]).bubble_fraction == 0.0


def test_events_handed_later_are_built_once_at_the_first_look():
    t, built = Timeline(["vgpu:0"]), []
    t.add(Event("vgpu:0", "F", 0, 0, 0.0, 1.0))
    t.add_later(lambda: built.append(1) or [Event("vgpu:0", "B", 0, 0, 1.0, 3.0)])
    assert built == []                                   # a step nobody reads never builds its events
    assert [e.kind for e in t.events] == ["F", "B"] and t.busy("vgpu:0") == 3.0
    assert built == [1] and len(t.events) == 2           # built once
    t.events = []
    assert t.makespan == 0.0


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(devices="vgpu:0"), r"the timeline's devices must be a list of device names .* got 'vgpu:0'"),
    (lambda d: d.update(devices=5), r"the timeline's devices must be a list of device names .* got 5"),
    (lambda d: d.update(events=None), r"the timeline's events must be a list of events, got NoneType"),
    (lambda d: d["events"][3].update(start="x"), r"event 3 of the timeline: start='x'; it must be a finite number"),
    (lambda d: d["events"][1].update(end=float("nan")), r"event 1 of the timeline: end=nan; it must be a finite"),
    (lambda d: d["events"][1].update(end=float("inf")), r"event 1 of the timeline: end=inf; it must be a finite"),
    (lambda d: d["events"][2].update(end=d["events"][2]["start"] - 4),
     r"event 2 of the timeline: end=.*; it must be at or after its start"),
    (lambda d: d["events"][0].update(kind="Z"), r"event 0 of the timeline: kind='Z'; it must be one of F, R, B, W"),
    (lambda d: d["events"][0].update(mb=-1), r"event 0 of the timeline: mb=-1; it must be a whole number >= 0"),
    (lambda d: d["events"][0].update(stage=1.5), r"event 0 of the timeline: stage=1.5; it must be a whole number"),
    (lambda d: d["events"][0].update(peer=3), r"event 0 of the timeline: peer=3; it must be a device name"),
], ids=["devices text", "devices a number", "events None", "start text", "end NaN", "end inf", "end before start",
        "unknown kind", "negative micro-batch", "fractional stage", "peer a number"])
def test_from_dict_refuses_a_malformed_field_naming_the_event_and_the_field(change, words):
    d = two_device_gpipe().to_dict()
    change(d)
    with pytest.raises(ValueError, match=words):
        Timeline.from_dict(d)
