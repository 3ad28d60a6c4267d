"""profile measures every layer on the device's worker: times, saved activations, sizes; Costs round-trips."""
import json
import threading

import pytest
import torch
from torch import nn

from conftest import make_batch, tiny_model
from mpedu.core import Placement
from mpedu.predict import Costs, StageCost, profile


class Square(nn.Module):
    """x * x saves x twice (once per operand): the same storage must count once."""

    def forward(self, x, state=None):
        return x * x, None


def test_profile_measures_every_layer_of_a_micro_batch():
    model, batch = tiny_model(num_layers=2), make_batch(T=9, B=8)
    costs = profile(model, batch, micro_batches=4, warmup=1, repeats=3)
    assert costs.names == ["embed", "lstm0", "lstm1", "decode"]
    assert costs.micro_batch == (9, 2) and costs.device == "vgpu:0"
    assert all(t > 0 for t in costs.forward + costs.backward)
    assert all(t > 0 for t in costs.backward_weight)
    assert costs.backward_input[0] == 0.0                # token ids get no gradient
    assert all(t > 0 for t in costs.backward_input[1:])
    # (T, b, E=32) then (T, b, H=64) float32 cross each boundary; nothing after the loss
    assert costs.output_bytes == [9 * 2 * 32 * 4, 9 * 2 * 64 * 4, 9 * 2 * 64 * 4, 0]
    assert costs.param_bytes == [4 * sum(p.numel() for p in model.layers[n].parameters()) for n in costs.names]
    assert costs.activation_bytes[0] == 0                # the embedding keeps only the token ids: the step's own
    for k in (1, 2):                                     # an LSTM keeps at least its input and output
        assert costs.activation_bytes[k] >= costs.output_bytes[k - 1] + costs.output_bytes[k]
    assert costs.shared_bytes[0] == 0 and costs.shared_bytes[2] >= costs.output_bytes[1]
    assert all(p.grad is None for p in model.parameters()), "profiling left gradients behind"


def test_saved_storages_count_once_and_weights_are_not_activations():
    model = tiny_model(num_layers=2)
    model.layers["lstm1"] = Square()
    costs = profile(model, make_batch(T=9, B=8), micro_batches=2, warmup=0, repeats=1)
    assert costs.activation_bytes[2] == 9 * 4 * 64 * 4   # x, once, though saved for both operands
    assert costs.param_bytes[2] == 0 and costs.backward_weight[2] == 0.0


def test_repeats_0_weighs_without_timing():
    model, batch = tiny_model(), make_batch(T=9, B=8)
    timed = profile(model, batch, micro_batches=2, warmup=0, repeats=1)
    weighed = profile(model, batch, micro_batches=2, warmup=3, repeats=0)
    assert weighed.activation_bytes == timed.activation_bytes and weighed.output_bytes == timed.output_bytes
    assert weighed.param_bytes == timed.param_bytes and weighed.input_saved_bytes == timed.input_saved_bytes
    assert set(weighed.forward + weighed.backward + weighed.backward_input) == {0.0} and min(timed.forward) > 0


def test_layers_run_on_the_devices_worker_single_threaded():
    model = tiny_model(num_layers=1)
    seen = []
    model.layers["lstm0"].register_forward_hook(
        lambda *_: seen.append((threading.current_thread().name, torch.get_num_threads())))
    profile(model, make_batch(), device="vgpu:1", warmup=0, repeats=1)
    assert seen and set(seen) == {("mpedu-vgpu:1", 1)}


def test_existing_gradients_survive_profiling():
    model, batch = tiny_model(num_layers=1), make_batch()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    profile(model, batch, warmup=0, repeats=1)
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())


def test_profiling_never_unsets_the_models_gradients_even_for_a_moment(monkeypatch):
    """The explorer profiles in the background while a learner's cell may train the same model. Profiling once
    set every .grad to None while it copied the model and put them back after: a backward running then lost its
    gradients or failed inside torch ("Bad in-place call ... dtype nullptr"). Each gradient seen as it is copied."""
    import copy
    model, batch = tiny_model(num_layers=1), make_batch()
    grads = {name: torch.full_like(p, 3.0) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = grads[name]
    real, intact = copy.deepcopy, []

    def watching(x, memo=None, _nil=[]):
        if x is model:          # the moment the copy is made
            intact.append(all(p.grad is grads[name] for name, p in model.named_parameters()))
        return real(x, memo, _nil)
    monkeypatch.setattr(copy, "deepcopy", watching)
    profile(model, batch, warmup=0, repeats=1)
    monkeypatch.undo()
    assert intact == [True]
    assert all(p.grad is grads[name] for name, p in model.named_parameters())


def test_stage_costs_add_up_layers_and_round_trip():
    names = ["embed", "lstm0", "lstm1", "decode"]
    costs = Costs(names, [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0], [0.0, 3.0, 5.0, 6.0], [2.0, 3.5, 5.5, 4.0],
                  [10, 100, 100, 50], [7, 8, 9, 0], [1, 2, 3, 4], [0, 5, 8, 8], (9, 2))
    model = tiny_model(num_layers=2)
    first, second = costs.stages(Placement.parse("embed,lstm0:vgpu0 | lstm1,decode:vgpu1", model))
    assert first == StageCost(3.0, 6.0, 0.0, 2.0 + 4.0, 8, 110 - 5, 3, ("embed", "lstm0"))
    # B: input gradients through both layers; W: lstm1's weights, after a full pass through decode
    assert second == StageCost(7.0, 14.0, 11.0, 5.5 + 8.0, 0, 150 - 8, 7, ("lstm1", "decode"),
                               input_bytes=8)      # lstm0's output: all a recomputing stage keeps
    assert Costs.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    text = costs.table()
    assert all(name in text for name in names) and "total" in text
    with pytest.raises(ValueError, match="not a run of consecutive layers"):
        costs.stages([["embed", "lstm1"], ["lstm0", "decode"]])
    with pytest.raises(ValueError, match="'lstm7' was not profiled"):
        costs.stages([["lstm7"]])


def test_a_split_stage_pays_its_recurrent_layers_backward_in_b_and_w_only_after_them():
    """As a Stage splits it: B does the weights of the layers up to the last recurrent one (their kernel computes
    them anyway), W the layers after it, re-walking only those."""
    names = ["embed", "lstm0", "lstm1", "decode"]
    forward, fused, b, w = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0], [0.0, 3.0, 5.0, 6.0], [2.0, 3.5, 5.5, 4.0]
    costs = Costs(names, forward, fused, b, w, [10, 100, 100, 50], [7, 8, 9, 0], [1, 2, 3, 4], [0, 5, 8, 8], (9, 2),
                  recurrent=[False, True, True, False])
    first, second = costs.stages([["embed", "lstm0"], ["lstm1", "decode"]])
    assert (first.backward_input, first.backward_weight) == (2.0 + 4.0, 0.0)          # all in B, nothing left
    assert (second.backward_input, second.backward_weight) == (6.0 + 6.0, 4.0)        # lstm1 whole + decode's dX; dW
    alone = costs.stages([["embed"], ["lstm0", "lstm1"], ["decode"]])
    assert [(c.backward_input, c.backward_weight) for c in alone] == [(0.0, 2.0), (10.0, 0.0), (6.0, 4.0)]
    assert profile(tiny_model(num_layers=2), make_batch(), repeats=1, warmup=0).recurrent == [False, True, True,
                                                                                                False]


def test_stage_cost_defaults_are_the_textbook_unit():
    unit = StageCost(1.5)
    assert (unit.backward, unit.backward_input, unit.backward_weight) == (3.0, 1.5, 1.5)


def test_a_profile_saved_with_the_old_forward_without_autograd_still_loads():
    costs = profile(tiny_model(num_layers=2), make_batch(), warmup=0, repeats=1)
    old = {**costs.to_dict(), "forward_nograd": [1.0] * len(costs.names)}   # timed before recomputation's
    assert Costs.from_dict(old) == costs        # first forward ran with autograd: now it costs the forward
    with pytest.raises(ValueError, match="unknown Costs fields"):
        Costs.from_dict({**costs.to_dict(), "forwards": 1})


def test_profiling_leaves_the_random_stream_alone():
    model, batch = tiny_model(num_layers=1, dropout=0.5), make_batch()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    profile(model, batch, warmup=0, repeats=1)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("device", ["vgpu:0", pytest.param("cuda:0", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_profile_measures_a_copy_and_leaves_the_model_where_it_is(device):
    """A live Pipeline's layers sit on its GPUs: profiling them there must not move them to
    another device, nor run backward into their gradients."""
    model, batch = tiny_model(num_layers=1), make_batch()
    model.eval()
    where = {name: (p.device, p.data_ptr()) for name, p in model.named_parameters()}
    touched = []
    for name, p in model.named_parameters():
        p.register_hook(lambda grad, name=name: touched.append(name))    # runs if backward reaches p
    costs = profile(model, batch, device=device, warmup=0, repeats=1)
    assert costs.device == device and all(t > 0 for t in costs.forward)
    assert {name: (p.device, p.data_ptr()) for name, p in model.named_parameters()} == where
    assert touched == [], "profile ran backward through the caller's parameters"
    assert not model.training
