"""An emulated link really delays transfers between virtual devices, leaves the numbers alone,
and the simulator charges it the same way.

Delays are made of sleeps of 20-60 ms, which a busy machine stretches but never shortens: a
measured transfer must take at least its link time, and at most that plus a generous slack.
"""
import json
import re
import statistics

import pytest
import torch

from conftest import make_batch, reference, tiny_model
from mpedu.cli import main
from mpedu.runtime import Channel, Device, Link, LINKS
from mpedu.course import NEIGHBOURS, measure_placements
from mpedu.core import Pipeline
from mpedu.predict import StageCost, simulate

SLACK = 0.15          # seconds a busy machine may add to a sleep-based delay (never subtracted)
TWO = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"
FOUR_STAGES = "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0 | decode:vgpu1"

pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


# -- the Link itself -------------------------------------------------------------------------------

def test_presets_are_latency_plus_bytes_over_bandwidth():
    assert set(LINKS) == {"shared", "pcie4", "nvlink", "10gbe", "100gbe"}
    assert Link() == LINKS["shared"] and Link().name == "shared memory" and not Link().emulated
    assert all(link.emulated for name, link in LINKS.items() if name != "shared")
    pcie = Link.parse("pcie4")
    assert pcie.time(25e6) == pytest.approx(pcie.latency_s + 1e-3)        # 25 MB at 25 GB/s: 1 ms
    assert LINKS["nvlink"].bandwidth_Bps > pcie.bandwidth_Bps > LINKS["10gbe"].bandwidth_Bps
    assert LINKS["100gbe"].bandwidth_Bps == 10 * LINKS["10gbe"].bandwidth_Bps
    assert Link.parse(" NVLink ") is LINKS["nvlink"] and Link.parse(None) is LINKS["shared"]
    assert Link.parse(pcie) is pcie


def test_slowed_keeps_a_gpu_ratio_on_cpu_cores():
    fast, slow = LINKS["10gbe"], Link.parse("10gbe/100")
    assert slow == fast.slowed(100) and slow.name == "10gbe/100" and slow.emulated
    for nbytes in (0, 1000, 224_000):
        assert slow.time(nbytes) == pytest.approx(100 * fast.time(nbytes))
    # even the shared default becomes an emulated link once slowed
    assert Link.parse("shared/2").emulated and Link.parse("shared/2").latency_s == pytest.approx(40e-6)


@pytest.mark.parametrize("spec,latency,bandwidth", [
    ("5ms,10MB/s", 5e-3, 10e6), ("50us, 10Gb/s", 50e-6, 1.25e9), ("0,inf", 0.0, float("inf")),
    ("2ms,1GB/s/4", 8e-3, 250e6), ("1s,8kb/s", 1.0, 1000.0),
])
def test_custom_links_are_latency_comma_bandwidth(spec, latency, bandwidth):
    link = Link.parse(spec)
    assert link.latency_s == pytest.approx(latency) and link.bandwidth_Bps == pytest.approx(bandwidth)


@pytest.mark.parametrize("spec,words", [
    ("pcie5", ["unknown link 'pcie5'", "shared, pcie4, nvlink, 10gbe, 100gbe", "10gbe/100"]),
    ("10gbe/0", ["factor after '/'", "10gbe/100"]),
    ("10gbe/fast", ["factor after '/'"]),
    ("5,10MB/s", ["latency '5' is not a time", "us"]),
    ("5ms,10MB", ["bandwidth '10MB'", "MB/s"]),
    ("5ms,-1MB/s", ["bandwidth '-1MB/s'"]),
])
def test_bad_link_text_says_what_to_write(spec, words):
    with pytest.raises(ValueError) as error:
        Link.parse(spec)
    for word in words:
        assert word in str(error.value)


def test_bad_numbers_say_what_to_give():
    with pytest.raises(ValueError, match=r"latency_s=-1.*seconds"):
        Link(-1)
    with pytest.raises(ValueError, match=r"bandwidth_Bps=0.*bytes per second"):
        Link(0.0, 0)
    with pytest.raises(ValueError, match="positive finite factor"):
        LINKS["pcie4"].slowed(0)
    with pytest.raises(TypeError, match="preset name"):
        Link.parse(3)


def test_a_direction_queues_transfers_for_its_bandwidth():
    channel = Channel(Link(1.0, 100.0))                     # 1 s latency, 100 B/s
    assert channel.arrival(0.0, 100) == pytest.approx(2.0)  # idle link: time(100) = 1 + 1
    assert channel.arrival(0.5, 100) == pytest.approx(3.0)  # waits for the wire until 1.0, not for the latency
    assert channel.arrival(10.0, 50) == pytest.approx(11.5)  # idle again


# -- the engine ------------------------------------------------------------------------------------


def test_a_transfer_takes_latency_plus_bytes_over_bandwidth_and_the_sender_goes_on(batch):
    model = tiny_model()
    nbytes = 9 * 4 * 64 * 4                                  # (T, b, hidden) floats of one micro-batch
    link = Link(0.02, nbytes / 0.02)                         # 20 ms + 20 ms
    with Pipeline(model, TWO, "gpipe", micro_batches=2, link=link) as pipe:
        assert "link=custom" in repr(pipe)
        tl = pipe.train_step(batch).timeline
    sends = tl.transfers()
    assert len(sends) == 4 and {e.bytes for e in sends} == {nbytes}
    f = {(e.kind, e.stage, e.mb): e for e in tl.compute()}
    first, second = [e for e in sends if e.device == "vgpu:0"]
    # the link time: the send spans it, and the receiver starts no earlier than its end
    assert link.time(nbytes) <= first.duration <= link.time(nbytes) + SLACK
    assert first.end <= f["F", 1, 0].start <= first.end + SLACK
    # the sender is not blocked: its next forward starts before its first tensor lands
    assert f["F", 0, 1].start < first.end
    # the second activation queued for the wire behind the first: it lands >= one more bytes / bandwidth later
    assert second.end >= first.end + nbytes / link.bandwidth_Bps - 1e-3
    assert f["F", 1, 1].start >= second.end


def test_the_trace_shows_long_sends_on_tracks_where_nothing_overlaps(batch):
    # Perfetto drops slices that overlap on one track without nesting; a 30 ms send overlaps the
    # sender's next actions and the next send, so sends get tracks (lanes) of their own
    with Pipeline(tiny_model(), TWO, "gpipe", micro_batches=4, link=Link(0.03)) as pipe:
        trace = pipe.train_step(batch).timeline.chrome_trace()["traceEvents"]
    slices = [e for e in trace if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {names[x["tid"]] for x in slices if x["cat"] == "send"} >= {"vgpu:0 sends", "vgpu:0 sends (2)"}
    for track in names:
        row = sorted((x["ts"], x["ts"] + x["dur"]) for x in slices if x["tid"] == track)
        assert all(end <= next_start + 1e-6 for (_, end), (next_start, _) in zip(row, row[1:])), names[track]


SCHEDULES = [("naive", TWO, 1, 1), ("gpipe", FOUR_STAGES, 2, 1), ("1f1b", TWO, 4, 1),
             ("interleaved", FOUR_STAGES, 2, 1), ("zb1", TWO, 2, 1), ("wavefront", TWO, 2, 3)]


@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES)
def test_a_slow_link_changes_no_loss_and_no_gradient(schedule, placement, m, chunks, batch):
    model = tiny_model()
    ref_loss, ref_grads = reference(model, batch)
    with Pipeline(model, placement, schedule, micro_batches=m, chunks=chunks, link="5ms,2MB/s") as pipe:
        result = pipe.train_step(batch)
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert all(e.duration >= 5e-3 for e in result.timeline.transfers())


def test_no_link_means_shared_memory_and_no_added_delay(batch):
    with Pipeline(tiny_model(), TWO, "gpipe", micro_batches=2) as pipe:
        assert pipe.link == LINKS["shared"] and not pipe.link.emulated and "link" not in repr(pipe)


def test_gpus_refuse_an_emulated_link(monkeypatch):
    # pretend vgpu:1 is a GPU (the check runs before anything is moved to a device)
    monkeypatch.setattr(Device, "is_cuda", property(lambda self: self.name == "vgpu:1"))
    with pytest.raises(ValueError, match=r"link='pcie4'.*vgpu:1, whose copies take their real time.*simulate"):
        Pipeline(tiny_model(), TWO, "gpipe", 2, link="pcie4")


# -- the simulator agrees ---------------------------------------------------------------------------

def test_the_simulator_takes_a_string_and_queues_like_the_engine():
    stages = [StageCost(1.0, output_bytes=100), StageCost(1.0)]
    link = Link(0.0, 10.0)                                     # 10 s per transfer
    tl = simulate("gpipe", stages, micro_batches=2, link=link)
    forward = [(e.start, e.end) for e in tl.transfers() if e.device == "gpu:0"]
    assert forward == [pytest.approx((1.0, 11.0)), pytest.approx((2.0, 21.0))]   # the second waits for the wire
    backward = [(e.start, e.end) for e in tl.transfers() if e.device == "gpu:1"]
    assert backward[0][1] - backward[0][0] == pytest.approx(10.0)                # the other direction is free
    assert simulate("gpipe", stages, micro_batches=2, link="0s,10B/s").makespan == pytest.approx(tl.makespan)


def test_simulator_and_engine_agree_that_cuts_cost_on_a_slow_link():
    """Notebook 05's lesson on the tiny model: with 30 ms transfers, the alternating placement's
    three cuts cost more than the contiguous one's single cut, measured and predicted alike."""
    model = tiny_model(num_layers=4)
    batch = make_batch(T=9, B=8, seed=3)
    runs = measure_placements(model, batch, NEIGHBOURS, Link(0.03), "gpipe", micro_batches=2, rounds=3)
    for run in runs.values():
        assert -0.25 <= run.error <= 0.10, (run.times, run.predicted.makespan)   # busy machines only add
        assert len(run.timeline.transfers()) == len(run.predicted.transfers())
    ratio = statistics.median(a / c for a, c in zip(runs["alternating"].times, runs["contiguous"].times))
    predicted = runs["alternating"].predicted.makespan / runs["contiguous"].predicted.makespan
    assert predicted > 1.5 and ratio > 1.3 and ratio == pytest.approx(predicted, rel=0.2)
    assert all(p.grad is None for p in model.parameters())


# -- the command line -------------------------------------------------------------------------------

def test_the_command_line_takes_a_link_and_names_it(capsys, tmp_path):
    quick = ["--config", "tiny", "--epochs", "1", "--limit-batches", "1", "--batch-size", "8", "--no-progress",
             "--no-baselines", "--out", str(tmp_path)]
    assert main(["train", *quick, "--link", "pcie4/1000", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["link"] == "pcie4/1000"
    assert "link pcie4/1000 (10 ms + bytes / 25 MB/s)" in out
    with pytest.raises(SystemExit) as stop:
        main(["train", *quick, "--link", "pcie5"])
    assert stop.value.code == 2 and "unknown link 'pcie5'" in capsys.readouterr().err
    assert main(["train", *quick, "--devices", "1", "--link", "10gbe"]) == 2
    assert "--devices 1 has no transfer" in capsys.readouterr().err


@pytest.mark.parametrize("link, words", [("1ms,1B/s", r"at least \d.* h"), ("1e9s,1GB/s", "at least 31.7 years"),
                                         ("pcie4/1e300", r"at least .*e\+\d+ years")])
def test_a_link_that_cannot_finish_a_step_is_refused_before_the_step_naming_the_time(link, words):
    model, batch = tiny_model(), make_batch()
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1", "gpipe", micro_batches=4, link=link) as pipe:
        assert pipe.transfer_time(batch) > 60
        with pytest.raises(ValueError, match=f"link {re.escape(str(pipe.link))}: one step's hand-offs on a "
                                             rf"\(9, 8\) batch would take {words}.*A typo\? '1ms,1GB/s'"):
            pipe.train_step(batch)
        assert all(p.grad is None for p in model.parameters())


def test_the_transfer_estimate_is_what_the_link_charges_the_busiest_direction():
    model, batch = tiny_model(), make_batch(T=9, B=8)
    link = Link(0.002, 1e6)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1", "gpipe", micro_batches=4, link=link) as pipe:
        # lstm0's output, 9 x 8 x 64 floats in all, crosses each way once per micro-batch: 4 x 2 x 9 x 64 x 4 bytes
        assert pipe.transfer_time(batch) == pytest.approx(0.002 + 9 * 8 * 64 * 4 / 1e6)
        assert pipe.transfer_time(batch) < 60 and pipe.train_step(batch).loss > 0
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1", "gpipe", micro_batches=4) as pipe:
        assert pipe.transfer_time(batch) == 0.0                        # shared memory: nothing emulated


def test_the_command_line_says_what_the_link_costs_before_the_first_step_and_refuses_a_typo(capsys, tmp_path):
    args = ["train", "--config", "tiny", "--epochs", "1", "--limit-batches", "2", "--batch-size", "16", "--no-baselines",
            "--no-progress", "--out", str(tmp_path)]
    assert main(args + ["--link", "10gbe/100"]) == 0
    assert re.search(r"link 10gbe/100: one step's hand-offs take at least [\d.]+ ms on the first batch \(\d+ x 16\)",
                     capsys.readouterr().out)
    assert main(args + ["--link", "1ms,1B/s", "--out", str(tmp_path / "typo")]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"at least [\d.]+ h on the first batch", out)
    assert "would take at least" in err and "A typo?" in err
