"""The explorer's refusals without a widget: a board and menu choice is accepted as a Placement and Schedule, or
refused in the learner's words with a fix that the choice then accepts."""
from types import SimpleNamespace

import pytest

from conftest import tiny_model
from mpedu.core import Placement
from mpedu.course import Refusal, check, dealt

DEVICES = ["vgpu:0", "vgpu:1"]


@pytest.fixture(scope="module")
def layers():
    return tiny_model(num_layers=3).layer_names             # embed, lstm0-2, decode: 5 layers


def board(layers, text):
    """The assignment (layer -> device name) a board shows for a placement string."""
    placement = Placement.parse(text, SimpleNamespace(layer_names=layers))
    return {k: v.name for k, v in placement.assignment.items()}


def choose(layers, assignment, schedule="gpipe", m=4, chunks=2, batch_width=8, devices=DEVICES):
    return check(layers, devices, assignment, schedule, schedule.upper(), m, chunks, batch_width)


def test_an_even_board_is_accepted_as_its_placement_and_schedule(layers):
    placement, schedule = choose(layers, board(layers, "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1"))
    assert str(placement) == "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1"
    assert (schedule.name, schedule.micro_batches, schedule.chunks) == ("gpipe", 4, 1)   # chunks: wavefront only
    _, wavefront = choose(layers, board(layers, "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1"), "wavefront", m=1)
    assert wavefront.chunks == 2


def test_an_empty_device_is_refused_without_a_fix(layers):
    with pytest.raises(Refusal, match="vgpu:1 holds no layer: drag a layer onto it") as refused:
        choose(layers, dict.fromkeys(layers, "vgpu:0"))
    assert refused.value.fix is None
    with pytest.raises(Refusal, match="3 devices but only 2 layers"):
        check(["embed", "decode"], ["vgpu:0", "vgpu:1", "vgpu:2"], {}, "gpipe", "GPipe", 1, 1, 8)


def test_two_stages_on_one_device_under_1f1b_offer_gpipe(layers):
    split = board(layers, "embed:vgpu0 | lstm0:vgpu1 | lstm1,lstm2,decode:vgpu0")
    with pytest.raises(Refusal, match="vgpu:0 holds 2: embed / lstm1 lstm2 decode") as refused:
        choose(layers, split, "zb1")
    text, setting, value = refused.value.fix
    assert (setting, value) == ("schedule", "gpipe") and "GPipe" in text
    assert choose(layers, split, value)[1].name == "gpipe"


def test_interleaving_offers_the_dealt_board_then_a_micro_batch_count_that_fits(layers):
    with pytest.raises(Refusal, match="dealt to the devices in turn") as refused:
        choose(layers, board(layers, "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1"), "interleaved")
    _, setting, dealing = refused.value.fix
    assert setting == "placement" and dealing == dealt(layers, DEVICES)
    with pytest.raises(Refusal, match="must be a multiple of 2; you chose 1. Pick 2 micro-batches") as refused:
        choose(layers, board(layers, dealing), "interleaved", m=1)
    assert refused.value.fix[1:] == ("micro_batches", 2)
    placement, schedule = choose(layers, board(layers, dealing), "interleaved", m=2)
    assert schedule.name == "interleaved" and len(placement.stages) == 4


def test_a_batch_with_no_fitting_micro_batch_count_names_the_device_counts_that_fit():
    layers = tiny_model(num_layers=4).layer_names            # 6 layers: 2 or 3 devices can interleave
    dealing = board(layers, dealt(layers, DEVICES))
    with pytest.raises(Refusal, match="splits into 1, 3 micro-batches, none a multiple of 2. Use 3 devices"):
        choose(layers, dealing, "interleaved", m=1, batch_width=3)


def test_dealt_cuts_the_layers_into_2p_runs_round_the_devices():
    assert dealt(["a", "b", "c", "d", "e"], DEVICES) == "a,b:vgpu0 | c:vgpu1 | d:vgpu0 | e:vgpu1"


def test_interleaved_with_no_micro_batch_count_that_fits_any_device_count_on_dealt_layers_says_pick_gpipe():
    from mpedu.course import check
    layers = ["embed", "lstm0", "lstm1", "lstm2", "lstm3", "decode"]
    devices = ["vgpu:0", "vgpu:1", "vgpu:2"]
    board = dict(zip(layers, devices * 2))          # dealt in turn, twice round
    with pytest.raises(Refusal) as caught:
        check(layers, devices, board, "interleaved", "interleaved 1F1B", 1, chunks=1, batch_width=1)
    message = str(caught.value)
    # 1F1B on layers dealt in turn would interleave them and be refused the same way: GPipe, or one stage a device
    assert "Use  devices" not in message and message.endswith("Drag each device's layers together (then 1F1B "
                                                              "runs one stage per device), or pick GPipe.")
    assert "a batch of 1 sequence splits into 1 micro-batch, none" in message
    assert caught.value.fix == ("use GPipe", "schedule", "gpipe")
