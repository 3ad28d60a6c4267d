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


def choose(layers, assignment, schedule="gpipe", m=4, chunks=2, batch_width=8, devices=DEVICES, **board_and_sizes):
    return check(layers, devices, assignment, schedule, schedule.upper(), m, chunks, batch_width, **board_and_sizes)


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


def test_a_v_schedule_takes_a_v_board_with_its_cut_and_refuses_any_other_with_the_v_as_its_fix(layers):
    from mpedu.course import V_SCHEDULES
    assert {"zbv", "dualpipev"} <= set(V_SCHEDULES)
    v = board(layers, "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu1 | decode:vgpu0")
    placement, schedule = choose(layers, v, "zbv", cuts=["lstm2"])
    assert placement.stage_devices == [0, 1, 1, 0] and schedule.name == "zbv"
    with pytest.raises(Refusal, match="ZBV needs the layers laid out as a V") as refused:
        choose(layers, v, "zbv")                          # without the cut: 3 stages, vgpu:1 holding one
    text, setting, value = refused.value.fix
    assert setting == "placement" and value == "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu1 | decode:vgpu0"
    assert choose(layers, board(layers, value), "zbv", cuts=["lstm2"])[0].stage_devices == [0, 1, 1, 0]
    # a cut whose neighbours sit on two devices is no cut: the even split stays two stages
    even = board(layers, "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1")
    assert len(choose(layers, even, "gpipe", cuts=["lstm2"])[0].stages) == 2


def test_dualpipev_needs_a_micro_batch_per_stage_and_a_v_two_layers_a_device(layers):
    v = board(layers, "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu1 | decode:vgpu0")
    with pytest.raises(Refusal, match="at least as many micro-batches as stages: 4 for 2 devices, but you chose 2. "
                                      "Pick 4 micro-batches or more, or pick ZB-V") as refused:
        choose(layers, v, "dualpipev", m=2, cuts=["lstm2"])
    assert refused.value.fix[1:] == ("micro_batches", 4)
    with pytest.raises(Refusal) as refused:                # a batch of 2: no count of 4 to offer
        choose(layers, v, "dualpipev", m=2, batch_width=2, cuts=["lstm2"])
    assert refused.value.fix == ("use ZB-V", "schedule", "zbv")
    three = ["vgpu:0", "vgpu:1", "vgpu:2"]
    with pytest.raises(Refusal, match="at least 6 layers for 3 devices; this model has 5. Use 2 devices or fewer"):
        choose(layers, board(layers, "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2,decode:vgpu2"), "zbv", devices=three)


def test_tied_layers_on_two_devices_are_refused_with_the_v_or_zb_v_as_the_fix(layers):
    even = board(layers, "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1")
    with pytest.raises(Refusal, match="embed and decode share one weight matrix .tied weights., so they must sit on "
                                      "one device, but embed is on vgpu:0 and decode on vgpu:1") as refused:
        choose(layers, even, "gpipe", tied=[("embed", "decode")])
    assert refused.value.fix[1] == "placement"           # GPipe runs the V as it is
    with pytest.raises(Refusal) as refused:
        choose(layers, even, "1f1b", tied=[("embed", "decode")])
    assert refused.value.fix == ("use ZB-V", "schedule", "zbv")   # 1F1B would refuse a V's two stages a device
    v = board(layers, "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu1 | decode:vgpu0")
    assert choose(layers, v, "zbv", cuts=["lstm2"], tied=[("embed", "decode")])[1].name == "zbv"


def test_the_sizes_box_is_read_as_sequences_adding_up_to_the_batch_or_refused_in_its_words():
    from mpedu.course import read_sizes
    assert read_sizes("", 8) is None and read_sizes("  ", 8) is None          # empty: equal micro-batches
    assert read_sizes("1, 3,3 1", 8) == (1, 3, 3, 1)
    for text, words in (("1,3,3", "sizes 1, 3, 3 add up to 7 sequences, but the batch holds 8"),
                        ("2,-1,7", "“-1” is not a number of sequences"), ("8,0", "at least 1 sequence"),
                        ("1.5,6.5", "“1.5” is not a number"), ("4,²,2", "“²” is not a number")):
        with pytest.raises(Refusal, match=words) as refused:
            read_sizes(text, 8)
        assert refused.value.fix == ("use equal micro-batches", "sizes", "")
        assert "_" not in str(refused.value)
    with pytest.raises(Refusal, match="such as 4,12,12,4"):                    # its example adds up to the batch
        read_sizes("1", 32)


def test_unequal_sizes_give_the_micro_batch_count(layers):
    dealing = board(layers, dealt(layers, DEVICES))
    _, schedule = check(layers, DEVICES, dealing, "interleaved", "interleaved 1F1B", 1, 1, 8, sizes=(1, 3, 3, 1))
    assert schedule.micro_batches == 4                    # the slider's 1 is not what runs
    with pytest.raises(Refusal, match="you chose 3"):
        check(layers, DEVICES, dealing, "interleaved", "interleaved 1F1B", 4, 1, 8, sizes=(2, 3, 3))
