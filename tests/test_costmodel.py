"""The GPU cost model: LSTM layers are bound by their sequential steps, the decoder by arithmetic."""
import pytest

from mpedu.predict import Costs, GPUSpec, gpu_costs, layer_times, simulate
from mpedu.lm import LSTMLM
from mpedu.core import Placement


def test_an_lstm_layer_pays_per_time_step_not_per_sequence():
    spec = GPUSpec()
    short, long = (sum(layer_times("lstm", T, 8, 400, 400, spec)) for T in (35, 70))
    assert long == pytest.approx(2 * short, rel=0.05)           # twice the steps, twice the time
    few, many = (sum(layer_times("lstm", 35, b, 400, 400, spec)) for b in (8, 16))
    assert many < 1.1 * few                                      # twice the sequences: nearly free (latency-bound)
    faster_launch = GPUSpec(launch_s=spec.launch_s / 2)
    assert sum(layer_times("lstm", 35, 8, 400, 400, faster_launch)) < 0.6 * short


def test_the_decoder_is_bound_by_arithmetic():
    spec, fast = GPUSpec(), GPUSpec(flops=2 * GPUSpec().flops)
    slow_gpu, fast_gpu = (sum(layer_times("decode", 35, 8, 400, 10_000, s)) for s in (spec, fast))
    assert fast_gpu < 0.7 * slow_gpu
    assert layer_times("embed", 35, 8, 10_000, 200, spec)[1] == 0.0       # token ids get no gradient


def test_gpu_costs_keep_the_bytes_and_favour_the_howtos_left_pipeline():
    model = LSTMLM.from_config("mxnet8", 10_000, dropout=0.0)
    n = len(model.layer_names)
    # A CPU-like profile: the decoder costs six LSTM layers; bytes as profiled.
    cpu = Costs(model.layer_names, [1e-3] + [5e-3] * 8 + [30e-3], [2e-3] + [10e-3] * 8 + [60e-3],
                [0.0] + [5e-3] * 9, [1e-3] + [5e-3] * 9, list(range(n)), [448_000] * (n - 1) + [0],
                list(range(100, 100 + n)), [0] * n, (35, 8))
    gpu = gpu_costs(cpu, model)
    assert gpu.param_bytes == cpu.param_bytes and gpu.output_bytes == cpu.output_bytes
    assert gpu.device == "GPU cost model"
    lstm, decode = gpu.names.index("lstm3"), gpu.names.index("decode")
    assert gpu.forward[lstm] + gpu.backward[lstm] > gpu.forward[decode] + gpu.backward[decode]
    left = Placement.parse("embed,lstm0-3:vgpu0 | lstm4-7,decode:vgpu1", model)
    right = Placement.parse("embed,lstm0-6:vgpu0 | lstm7,decode:vgpu1", model)
    step = {(name, c.device): simulate("gpipe", c, p, micro_batches=4).makespan
            for c in (cpu, gpu) for name, p in (("left", left), ("right", right))}
    assert step["left", gpu.device] < step["right", gpu.device]       # the how-to's answer on GPUs
    assert step["right", cpu.device] < step["left", cpu.device]       # and the opposite on CPU-like costs


def test_unknown_layers_and_bad_specs_are_refused():
    with pytest.raises(ValueError, match="kind"):
        layer_times("conv", 35, 8, 1, 1, GPUSpec())
    with pytest.raises(ValueError, match="launch_s"):
        GPUSpec(launch_s=0)
