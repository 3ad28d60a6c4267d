"""Memory caps: the estimate against the measured peak, a cap refused before the step, what fits."""
import math
import re

import pytest

import mpedu.cli.commands as cli
from conftest import make_batch, tiny_model
from mpedu.predict import cap_memory, memory_estimate, MemoryCapError
from mpedu.core import Pipeline


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


TWO = "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"          # the tiny config has lstm0, lstm1


# ---------------------------------------------------------------- memory caps

def test_the_memory_estimate_matches_the_measured_activation_peak():
    batch = make_batch(B=16)
    for schedule in ("gpipe", "1f1b", "zb1"):
        with Pipeline(tiny_model(), "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", schedule, micro_batches=8) as pipe:
            needs = memory_estimate(pipe, batch)
            timeline = pipe.train_step(batch).timeline
        for need in needs:
            assert need.activations == pytest.approx(timeline.peak_memory(need.device), rel=0.02), (schedule, need)
        params = sum(p.numel() * 4 for p in pipe.model.parameters())
        assert sum(n.weights for n in needs) == sum(n.gradients for n in needs) == params
    assert [n.in_flight for n in needs] == [2, 2]       # zb1 on 2 devices


def test_a_placement_over_its_cap_fails_before_the_step_naming_one_that_fits(monkeypatch):
    batch = make_batch(B=16)
    model = tiny_model()
    ran = []
    with cap_memory(Pipeline(model, "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", "1f1b", micro_batches=8), {"vgpu1": "600kB"}) as pipe:
        original = pipe.stages[0].forward
        pipe.stages[0].forward = lambda *a, **k: ran.append(1) or original(*a, **k)
        with pytest.raises(MemoryCapError) as err:
            pipe.train_step(batch)
        assert not ran, "nothing may run before the memory check"
        message = str(err.value)
        assert message.startswith("vgpu:1 needs 767 kB for a training step on batches of T=9, B=16 (1f1b, 8 "
                                  "micro-batches): parameters 282 kB + gradients 282 kB + activations 203 kB (1 "
                                  "micro-batch held at once); more than its memory_cap 600 kB")
        fits = message.split("A placement that fits: '")[1].split("'")[0]
    with cap_memory(Pipeline(tiny_model(), fits, "1f1b", micro_batches=8), {"vgpu:1": "600kB"}) as pipe:
        assert all(n.fits for n in memory_estimate(pipe, batch))
        assert math.isfinite(pipe.train_step(batch).loss)


def test_no_placement_fits_says_how_many_devices_would():
    with cap_memory(Pipeline(tiny_model(), "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", "gpipe", micro_batches=8), "1.2MB") as pipe:
        with pytest.raises(MemoryCapError, match="No placement over these 2 devices fits; over 3 devices with 1.2 MB "
                                                 "each, one does: 'embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2,decode:vgpu2'"
                                                 r".*1f1b keeps at most 2 per device"):
            pipe.train_step(make_batch(B=16))
    with cap_memory(Pipeline(tiny_model(), 2, "gpipe", micro_batches=8), "50kB") as pipe:
        with pytest.raises(MemoryCapError, match="No placement fits, even one layer per device: lstm.* alone needs"):
            pipe.train_step(make_batch(B=16))


def test_an_interleaved_step_over_its_cap_names_a_placement_that_runs():
    """Interleaved needs two or more stages per device, so the one-stage-per-device placement the message names
    is for 1f1b, and says so (it named a 3-device placement interleaved cannot run)."""
    batch = make_batch(T=12, B=8)
    with cap_memory(Pipeline(tiny_model(), "embed:vgpu0 | lstm0-1:vgpu1 | lstm2:vgpu0 | decode:vgpu1", "interleaved",
                  micro_batches=4), "1.14MB") as pipe:
        with pytest.raises(MemoryCapError, match="under 1f1b") as err:
            pipe.train_step(batch)
    fits = str(err.value).split("one stage each): '")[1].split("'")[0]
    with cap_memory(Pipeline(tiny_model(), fits, "1f1b", micro_batches=4), "1.14MB") as pipe:
        assert all(n.fits for n in memory_estimate(pipe, batch))
        assert math.isfinite(pipe.train_step(batch).loss)


@pytest.mark.parametrize("m,chunks", [(2, 3), (1, 4)])
def test_a_refusal_with_chunks_of_two_lengths_names_a_placement_that_fits(m, chunks):
    # T=10 in 3 or 4 time chunks: chunks of 4 and 3, or 3 and 2 steps. A recomputing stage rebuilds one chunk at
    # a time, the longest the most: sized as an average chunk, a placement was named that the cap then refused
    batch, layout = make_batch(T=10, B=8), "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1"
    named = 0
    for recompute in (None, "all", "all-but-last"):
        with Pipeline(tiny_model(), layout, "wavefront", micro_batches=m, chunks=chunks, recompute=recompute) as pipe:
            need = max(f.total for f in memory_estimate(pipe, batch))
        for share in (0.97, 0.9, 0.8, 0.7):
            cap = int(need * share)
            with cap_memory(Pipeline(tiny_model(), layout, "wavefront", micro_batches=m, chunks=chunks, recompute=recompute), cap) as pipe:
                with pytest.raises(MemoryCapError) as err:
                    pipe.train_step(batch)
            named_here = re.search(r"(A placement that fits|one does)[^:']*: '([^']+)'", str(err.value))
            if not named_here:
                continue
            fits = named_here.group(2)
            with cap_memory(Pipeline(tiny_model(), fits, "wavefront", micro_batches=m, chunks=chunks, recompute=recompute), cap) as pipe:
                assert all(n.fits for n in memory_estimate(pipe, batch)), (recompute, share, fits)
            named += 1
    assert named >= 3


def test_memory_cap_from_the_command_line(capsys, tmp_path):
    quick = ["train", "--config", "tiny", "--epochs", "1", "--limit-batches", "2", "--batch-size", "16",
             "--no-progress", "--no-baselines", "--out", str(tmp_path)]
    assert cli.main([*quick, "--memory-cap", "vgpu:0=100kB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpedu: error: vgpu:0 needs") and "memory_cap 100 kB" in err and "fits" in err
    assert cli.main([*quick, "--memory-cap", "1GB"]) == 0
    with pytest.raises(SystemExit):
        cli.main([*quick, "--memory-cap", "lots"])
    assert "memory size 'lots'" in capsys.readouterr().err


def test_a_layer_thawed_after_the_first_step_is_checked_against_the_cap_again():
    # the cap was checked once per batch shape, whatever trained: thawing three layers after step 1 let vgpu:0
    # go on to hold 1.3 MB under a 743 kB cap, and memory_estimate kept the frozen model's figures
    model, batch = tiny_model(), make_batch(T=10, B=8)
    layout = "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1"
    for name in ("embed", "lstm0", "lstm1"):
        model.layers[name].requires_grad_(False)
    with Pipeline(model, layout, "gpipe", micro_batches=4) as pipe:
        cap = max(f.total for f in memory_estimate(pipe, batch))
    with cap_memory(Pipeline(model, layout, "gpipe", micro_batches=4), cap) as pipe:
        assert math.isfinite(pipe.train_step(batch).loss)
        for name in ("embed", "lstm0", "lstm1"):
            model.layers[name].requires_grad_(True)
        thawed = memory_estimate(pipe, batch)
        with Pipeline(model, layout, "gpipe", micro_batches=4) as fresh:
            assert [f.total for f in thawed] == [f.total for f in memory_estimate(fresh, batch)]
        assert max(f.total for f in thawed) > cap
        with pytest.raises(MemoryCapError, match="vgpu:0 needs"):
            pipe.train_step(batch)


def test_the_estimate_is_of_a_training_step_whatever_mode_the_model_is_in():
    # measured after an eval step (dropout off), the estimate missed the dropout masks a training step keeps
    model, batch = tiny_model(dropout=0.3), make_batch(T=10, B=8)
    with Pipeline(model, "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1", "gpipe", micro_batches=4) as pipe:
        pipe.eval_step(batch)
        after_eval = memory_estimate(pipe, batch)
        timeline = pipe.train_step(batch).timeline
    for need in after_eval:          # the activations a training step really held (saved-tensor hooks)
        assert need.activations == pytest.approx(timeline.peak_memory(need.device), rel=0.02), need


def test_a_refusal_over_frozen_layers_names_a_placement_that_fits():
    # frozen embed and lstm0 keep nothing in the first stage, but lstm0 keeps its all as the first layer of a
    # later stage: measured in place, a refusal named placements with lstm0 after a cut as if free (24 of 30)
    batch, start = make_batch(T=10, B=8), "embed,lstm0,lstm1:vgpu0 | lstm2,decode:vgpu1"

    def frozen():
        model = tiny_model()
        for name in ("embed", "lstm0"):
            model.layers[name].requires_grad_(False)
        return model
    named = 0
    for c0 in (20_000, 50_000, 100_000):            # vgpu:0 holds embed alone at most
        for c1 in range(1_300_000, 2_000_000, 100_000):
            cap = {"vgpu:0": c0, "vgpu:1": c1}
            with cap_memory(Pipeline(frozen(), start, "gpipe", micro_batches=2), cap) as pipe:
                try:
                    pipe.train_step(batch)
                    continue
                except MemoryCapError as e:
                    found = re.search(r"A placement that fits: '([^']+)'", str(e))
            if found:
                named += 1
                with cap_memory(Pipeline(frozen(), found.group(1), "gpipe", micro_batches=2), cap) as pipe:
                    assert all(n.fits for n in memory_estimate(pipe, batch)), (cap, found.group(1))
    assert named >= 3
