"""Memory per device: parameters, gradients, optimizer state and saved activations of a pipeline step."""
import pytest
import torch
from matplotlib.patches import Rectangle

from conftest import make_batch, tiny_model
from mpedu.predict import cap_memory, memory_report
from mpedu.core import Pipeline

BALANCED = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"


def nbytes(params):
    return sum(p.numel() * p.element_size() for p in params)


def step(schedule, m=4, B=8, placement=BALANCED, model=None, optimizer=None):
    model = model if model is not None else tiny_model()
    with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
        timeline = pipe.train_step(make_batch(B=B)).timeline
        opt = optimizer(model) if optimizer else None
        return model, pipe, timeline, memory_report(pipe, timeline, opt)


def test_gpipe_peaks_at_m_micro_batches_of_activations_1f1b_at_p():
    """The known difference, through the report: on the first device GPipe holds all m = 8
    micro-batches' activations before the first backward; 1F1B never more than p = 2."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        _, _, timeline, report = step(schedule, m=8, B=16)
        one_mb = max(e.memory for e in timeline.compute("vgpu:0"))
        peaks[schedule] = report["vgpu:0"].peak_activations / one_mb
        assert report["vgpu:0"].activations == timeline.memory_over_time("vgpu:0")
        assert report["vgpu:0"].activations[-1][1] == 0, "all activations are freed by the end of the step"
    assert peaks["gpipe"] == pytest.approx(8, rel=0.15)
    assert peaks["1f1b"] == pytest.approx(2, rel=0.15)


def test_parameters_and_gradients_are_counted_on_the_device_that_holds_them():
    model, pipe, _, report = step("gpipe", optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    layers = model.layers
    first = nbytes(p for name in ("embed", "lstm0") for p in layers[name].parameters())
    assert report["vgpu:0"].params == report["vgpu:0"].grads == first
    assert sum(d.params for d in report.devices) == nbytes(model.parameters())
    assert [d.optimizer for d in report.devices] == [0, 0], "plain SGD keeps no state"
    assert report["vgpu:1"].total == 2 * report["vgpu:1"].params + report["vgpu:1"].peak_activations


def test_tied_weights_are_counted_once():
    model = tiny_model(embed_size=64, tie_weights=True)
    _, _, _, report = step("gpipe", placement="embed,lstm0-2,decode:vgpu0", model=model)
    assert report["vgpu:0"].params == nbytes(model.parameters())   # parameters() yields a shared one once


@pytest.mark.parametrize("make,per_param", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 1),   # a momentum buffer
    (lambda m: torch.optim.Adam(m.layers["decode"].parameters()), None),    # fine-tuning the decoder alone
    (lambda m: torch.optim.Adam(m.parameters()), 2),                         # two moment estimates
])
def test_optimizer_state_before_and_after_its_first_step(make, per_param):
    model, pipe, timeline, before = step("1f1b", optimizer=make)
    if per_param is None:           # Adam's two moments of the decoder's weights, on the decoder's device alone
        held = {d.device: d.optimizer for d in before.devices}
        weights = sum(p.numel() * p.element_size() for p in model.layers["decode"].parameters())
        assert sorted(held.values()) == [0, 2 * weights], held
        return
    assert [d.optimizer for d in before.devices] == [per_param * d.params for d in before.devices]
    assert "has not stepped yet" in before.table()
    optimizer = make(model)
    optimizer.step()                                 # now torch has made the state: measured, not worked out
    after = memory_report(pipe, timeline, optimizer)
    for b, a in zip(before.devices, after.devices):
        assert a.optimizer == pytest.approx(b.optimizer, rel=0.01)   # Adam also keeps a scalar step count
    assert "has not stepped yet" not in after.table()


def test_table_and_pictures():
    _, _, _, report = step("gpipe", optimizer=lambda m: torch.optim.Adam(m.parameters()))
    text = report.table()
    assert text.splitlines()[0] in ("memory per device (kB)", "memory per device (MB)")
    assert "parameters" in text and "gradients" in text and "optimizer state" in text and "activations (peak)" in text
    assert [line.split()[0] for line in text.splitlines()[2:4]] == ["vgpu:0", "vgpu:1"]
    ax = report.plot()
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(bars) == 4 * 2, "four parts stacked on each of the two devices"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["vgpu:0", "vgpu:1"]
    scale = 1e3 if "(kB)" in ax.get_ylabel() else 1e6
    tops = [max(p.get_y() + p.get_height() for p in bars if round(p.get_x() + p.get_width() / 2) == i)
            for i in range(2)]
    assert tops == pytest.approx([d.total / scale for d in report.devices])
    over_time = report.plot_over_time()
    lines = over_time.get_lines()
    assert [line.get_label() for line in lines] == ["vgpu:0", "vgpu:1"]
    scale = 1e3 if "(kB)" in over_time.get_ylabel() else 1e6
    assert max(lines[0].get_ydata()) * scale == pytest.approx(report["vgpu:0"].peak_activations, rel=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("placement", [
    pytest.param(BALANCED, id="cpu-twin"),
    pytest.param("embed,lstm0:cuda:0 | lstm1-2,decode:vgpu:0", id="gpu-and-cpu",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_a_gpus_measured_peak_stands_beside_the_estimate(placement):
    model, pipe, _, report = step("gpipe", placement=placement)
    table = report.table()
    for d in report.devices:
        if d.device.startswith("cuda"):
            # it held at least its parameters and gradients at once (plus the context it leaves out)
            assert d.measured >= d.params + d.grads
        else:
            assert d.measured is None
    gpu = any(d.device.startswith("cuda") for d in report.devices)
    assert ("measured peak" in table) == gpu
    assert ("leaves out the CUDA context" in table) == gpu


def test_the_table_puts_a_measured_peak_beside_the_estimate():
    from mpedu.predict import DeviceMemory, MemoryReport
    report = MemoryReport([DeviceMemory("cuda:0", 1_000_000, 1_000_000, 0, 500_000, measured=3_200_000),
                           DeviceMemory("vgpu:0", 2_000, 2_000, 0, 0)])
    lines = report.table().splitlines()
    assert lines[0] == "memory per device (MB)" and lines[1].endswith("total  measured peak")
    assert lines[2].split()[-2:] == ["2.50", "3.20"]      # estimate, then measured
    assert lines[3].split()[-2:] == ["0.00", "-"]         # nothing measured on a virtual device
    assert "torch.cuda.max_memory_allocated" in lines[-1] and "cuDNN/cuBLAS workspaces" in lines[-1]


@pytest.mark.cuda
@pytest.mark.parametrize("placement", [
    pytest.param(BALANCED, id="cpu-twin"),
    pytest.param("embed,lstm0:cuda:0 | lstm1-2,decode:vgpu:0", id="gpu-and-cpu",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_the_memory_cap_message_gives_a_gpus_measured_peak(placement):
    from mpedu.predict import MemoryCapError
    with cap_memory(Pipeline(tiny_model(), placement, "gpipe", micro_batches=4), "1kB") as pipe:
        with pytest.raises(MemoryCapError) as info:
            pipe.train_step(make_batch())
    message = str(info.value)
    assert ("Measured on cuda:0 so far: a peak of" in message) == ("cuda" in placement)
    assert "Measured on vgpu" not in message


def test_a_measured_peak_reads_as_a_sentence(monkeypatch):
    import mpedu.predict.capacity as capacity
    monkeypatch.setattr(capacity, "measured_peak", lambda device: 12_345_678 if device == "cuda:1" else None)
    assert capacity.gpu_measured("vgpu:0") == ""
    text = capacity.gpu_measured("cuda:1")
    assert text.startswith(" Measured on cuda:1 so far: a peak of 12.3 MB allocated; the estimate leaves out")
    assert text.endswith(".")
