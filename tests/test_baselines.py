"""Baselines: a pipeline measured beside one virtual device and one all-cores device, on copies of its model."""
import pytest
import torch

from conftest import make_batch, tiny_model
from mpedu.course import Baselines, measure_baselines
from mpedu.runtime import usable_cores
from mpedu.core import Pipeline


def test_three_runners_are_timed_on_copies_and_the_model_is_untouched():
    model = tiny_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", "1f1b", micro_batches=4) as pipe:
        threads = torch.get_num_threads()
        found = measure_baselines(pipe, [make_batch(B=6, seed=s) for s in range(2)], rounds=2)
    # a width of 6 is padded to 8 for 4 micro-batches, as training does; every runner trained for real
    assert found.pipeline > 0 and found.one_virtual_device > 0 and found.all_cores > 0
    assert (found.threads, found.devices, found.rounds) == (len(usable_cores()), 2, 2)
    assert torch.get_num_threads() == threads                        # the caller's count is restored
    assert all(p.grad is None for p in model.parameters())           # copies trained, not the model
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    with pytest.raises(ValueError, match="at least one batch"):
        measure_baselines(pipe, [])


def test_the_lines_name_each_runner_and_say_why_all_cores_can_win():
    slow = Baselines(pipeline=150.0, one_virtual_device=100.0, all_cores=180.0, threads=2, devices=2, rounds=3)
    lines = slow.lines()
    assert "3 rounds in turn" in lines[0] and "2 virtual devices (a core each) 150 tokens/s" in lines[0]
    assert "one virtual device" in lines[1] and "1.50x as fast" in lines[1]
    assert "2 intra-op threads" in lines[2] and "0.83x as fast" in lines[2] and "no bubble" in lines[2]
    assert "no bubble" not in Baselines(150.0, 100.0, 120.0, 2, 2, 3).lines()[2]
    assert slow.summary() == {"tokens_per_s_pipeline": 150.0, "tokens_per_s_one_virtual_device": 100.0,
                              "tokens_per_s_one_device_all_cores": 180.0, "intra_op_threads_all_cores": 2,
                              "pipeline_vs_one_virtual_device": 1.5, "pipeline_vs_one_device_all_cores": 0.833}
