"""CostCurve reads per-layer costs at any micro-batch shape from a few profiles; profile_curve takes them."""
import pytest

from conftest import fake_costs, make_batch, tiny_model
from mpedu.predict import CostCurve, profile_curve
from mpedu.runtime import chunk_bounds


def test_costcurve_reproduces_its_profiles_and_interpolates_between():
    names = ["embed", "lstm0", "decode"]
    curve = CostCurve([fake_costs(names, 10, b) for b in (2, 8)],
                      [fake_costs(names, T, 2) for T in (4, 20)])
    for b in (2, 8):
        assert curve.at(10, b).forward == pytest.approx(fake_costs(names, 10, b).forward)
    # time is linear in b and in T in fake_costs, so the reading is exact in between and beyond
    for T, b in [(10, 5), (6, 2), (16, 4), (30, 12)]:
        want = fake_costs(names, T, b)
        got = curve.at(T, b)
        assert got.forward == pytest.approx(want.forward, rel=1e-9)
        assert got.activation_bytes == pytest.approx(want.activation_bytes, rel=1e-6, abs=1)
        assert got.param_bytes == want.param_bytes
        assert got.micro_batch == (T, b)
    round_trip = CostCurve.from_dict(curve.to_dict())
    assert round_trip.at(7, 3).backward == pytest.approx(curve.at(7, 3).backward)


def test_costcurve_charges_a_time_chunk_its_own_overhead():
    names = ["embed", "lstm0", "decode"]
    curve = CostCurve([fake_costs(names, 12, b, per_call=1e-3) for b in (2, 4)],
                      [fake_costs(names, T, b, per_call=1e-3) for T in (3, 6) for b in (2, 4)])
    for chunks in (2, 3, 4):
        chunked = curve.at(12, 4, chunks)
        one_chunk = fake_costs(names, 12 // chunks, 4, per_call=1e-3)
        assert chunked.forward == pytest.approx([chunks * x for x in one_chunk.forward])
        # more chunks, more calls: a step in chunks costs more than the whole sequence at once
        assert all(a > b for a, b in zip(chunked.forward, curve.at(12, 4).forward))
    with pytest.raises(ValueError, match="chunks <= T"):
        curve.at(3, 2, chunks=4)


def test_costcurve_refuses_mixed_lengths_in_its_width_profiles():
    names = ["embed", "decode"]
    with pytest.raises(ValueError, match="share one length"):
        CostCurve([fake_costs(names, 10, 2), fake_costs(names, 12, 4)], [])



def test_profile_curve_profiles_every_width_and_length_asked_for():
    model, batch = tiny_model(num_layers=1), make_batch(T=9, B=8)
    curve = profile_curve(model, batch, widths=[2, 8], lengths=[4], warmup=0, repeats=1)
    assert [c.micro_batch for c in curve.widths] == [(9, 2), (9, 8)]
    assert [c.micro_batch for c in curve.lengths] == [(4, 2)]           # at the narrowest width by default
    assert curve.at(9, 8).forward == pytest.approx(curve.widths[1].forward)
    with pytest.raises(ValueError, match="width 3 does not divide the batch's 8 columns"):
        profile_curve(model, batch, widths=[3])
    with pytest.raises(ValueError, match="length 12 is outside the batch's 1..9 time steps"):
        profile_curve(model, batch, widths=[8], lengths=[12], warmup=0, repeats=1)


@pytest.mark.parametrize("T,m,chunks", [(15, 8, 1), (5, 2, 1), (8, 1, 1), (10, 2, 3), (7, 1, 4)])
def test_bytes_at_a_weighed_shape_are_what_a_step_holds(T, m, chunks):
    """An LSTM's saved bytes grow in blocks with T (oneDNN's workspace), so a curve through other lengths
    misses by up to ~40%; weighed at the shape, the footprint is the step's, time chunks of two lengths
    included."""
    from mpedu.predict import device_footprints
    from mpedu.core import Pipeline
    model = tiny_model()
    curve = profile_curve(model, make_batch(T=20, B=8), widths=[1, 2, 8], lengths=[10], warmup=0, repeats=1)
    curve.weigh(model, [(hi - lo, 8 // m) for lo, hi in chunk_bounds(T, chunks)])
    assert len(curve.weighed) >= 1
    batch = make_batch(T=T, B=8, seed=3)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", "wavefront" if chunks > 1 else "1f1b",
                  micro_batches=m, chunks=chunks) as pipe:
        held = pipe.train_step(batch).timeline
        predicted = device_footprints(curve.at(T, 8 // m, chunks), pipe.placement, pipe.schedule)
    for f in predicted:
        assert f.activations == pytest.approx(held.peak_memory(f.device), rel=0.01), (f.device, T, m)


def test_plan_buckets_weighs_each_buckets_shapes():
    from mpedu.predict import plan_buckets
    model = tiny_model()
    curve = profile_curve(model, make_batch(T=20, B=8), widths=[2, 8], lengths=[10], warmup=0, repeats=1)
    plan_buckets(model, [(6, 8), (13, 8)], 2, curve, micro_batches=(1, 4), schedules=("gpipe", "wavefront"),
                 chunks=(2,))
    assert {(6, 8), (6, 2), (13, 8), (13, 2), (3, 8), (3, 2), (7, 2)} <= set(curve.weighed)
