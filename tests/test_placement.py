"""Placements (MXNet's group2ctx): parsing, stages, and errors that teach."""
import pytest
from hypothesis import given, strategies as st

from conftest import FUZZ, tiny_model
from mpedu.runtime import get_device
from mpedu.core import Placement


@pytest.fixture
def model():
    return tiny_model(num_layers=4)   # embed, lstm0..lstm3, decode


def test_parse_groups_ranges_and_device_spellings(model):
    p = Placement.parse("embed, lstm0-1 : vgpu0 | lstm2-3,decode:vgpu:1", model)
    assert {k: v.name for k, v in p.assignment.items()} == {
        "embed": "vgpu:0", "lstm0": "vgpu:0", "lstm1": "vgpu:0",
        "lstm2": "vgpu:1", "lstm3": "vgpu:1", "decode": "vgpu:1"}
    assert p.stages == [(get_device("vgpu0"), ["embed", "lstm0", "lstm1"]),
                        (get_device("vgpu1"), ["lstm2", "lstm3", "decode"])]
    assert str(p) == "embed,lstm0-1:vgpu0 | lstm2-3,decode:vgpu1"
    assert Placement.parse(str(p), model) == p


def test_a_device_may_hold_several_stages(model):
    p = Placement.parse("embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0 | lstm3,decode:vgpu1", model)
    assert len(p.stages) == 4
    assert [d.name for d in p.devices] == ["vgpu:0", "vgpu:1"]
    assert p.stage_devices == [0, 1, 0, 1]


def test_dict_and_even_and_single(model):
    p = Placement.from_dict({n: "vgpu:1" if n in ("lstm3", "decode") else "vgpu:0" for n in model.layer_names},
                            model)
    assert p.stage_devices == [0, 1]
    even = Placement.even(model, 3)
    assert [names for _, names in even.stages] == [["embed", "lstm0"], ["lstm1", "lstm2"], ["lstm3", "decode"]]
    assert len(Placement.even(model, ["vgpu:0", "vgpu:1", "vgpu:2", "vgpu:3"]).stages) == 4
    assert Placement.single(model).stage_devices == [0]


@pytest.mark.parametrize("text,message", [
    ("embed,lstm0-3:vgpu0 | lstm9,decode:vgpu1", "layer 'lstm9' is not in the model; its layers are embed"),
    ("embed,lstm0-3:vgpu0", "layer 'decode' is not placed on any device"),
    ("embed,lstm0-3:vgpu0 | lstm3,decode:vgpu1", "layer 'lstm3' is placed twice"),
    ("embed,lstm0-3,decode:tpu0", "device 'tpu0' does not exist; this machine offers .*vgpu:0"),
    ("embed,lstm0-3,decode:vgpu99", "device 'vgpu99' does not exist"),
    ("", "empty placement"),
    ("embed,lstm0-3,decode", "has no device"),
    ("embed,lstm3-0,decode:vgpu0", "runs backwards; write lstm0-3"),
    (":vgpu0", "names no layers"),
])
def test_bad_placements_name_the_layer_or_device(model, text, message):
    with pytest.raises(ValueError, match=message):
        Placement.parse(text, model)


def test_even_refuses_more_devices_than_layers(model):
    with pytest.raises(ValueError, match="7 devices but only 6 layers"):
        Placement.even(model, [f"vgpu:{i}" for i in range(7)])
    with pytest.raises(ValueError, match="need at least one device"):
        Placement.even(model, 0)


# ---------------------------------------------------------------- bad input, fuzzed

PIECES = ["embed", "lstm", "decode", "0", "1", "2", "9", "-", ",", ":", "|", " ", "vgpu", "cuda", "cpu", "x", "::"]


placement_text = st.one_of(st.lists(st.sampled_from(PIECES), max_size=10).map("".join), st.text(max_size=30))


def _placement_or_a_message(build) -> None:
    """build(model) gives a placement of every layer, or a ValueError with a message; nothing else."""
    model = tiny_model(num_layers=2)
    try:
        placement = build(model)
    except ValueError as e:
        assert str(e)
    else:
        assert sorted(placement.assignment) == sorted(model.layer_names)


@given(placement_text)
@FUZZ
def test_random_placement_strings_give_a_value_error(text):
    _placement_or_a_message(lambda model: Placement.parse(text, model))


def test_a_layer_range_wider_than_the_model_is_refused_at_once():
    """Regression: Placement.parse spelled a range out before checking it ('lstm0-999999999'
    took minutes and gigabytes); now it refuses any range wider than the model first."""
    with pytest.raises(ValueError, match="layer range 'lstm0-999999999' is wider than the model"):
        Placement.parse("embed,lstm0-999999999,decode:vgpu0", tiny_model())


@given(st.dictionaries(st.sampled_from(["embed", "lstm0", "lstm1", "decode", "lstm9", "", "Embed"]),
                       st.one_of(st.sampled_from(["vgpu:0", "vgpu1", "vgpu:99", "cuda:0", "cpu", "gpu", ""]),
                                 st.integers(-3, 3), st.none()), max_size=6))
@FUZZ
def test_random_placement_dicts_give_a_value_error(mapping):
    _placement_or_a_message(lambda model: Placement.from_dict(mapping, model))


def test_placement_parse_gives_a_value_error_for_a_bare_device_number():
    """Regression: Placement.parse(':0') raised IndexError from deep inside."""
    with pytest.raises(ValueError, match="names no layers"):
        Placement.parse(":0", tiny_model())


# ---- the V shape: two stages of one device ----------------------------------------------------------------------

def test_two_groups_on_one_device_are_two_stages_and_print_back(model):
    text = "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu1 | lstm3,decode:vgpu0"
    v = Placement.parse(text, model)
    assert v.stage_devices == [0, 1, 1, 0] and [names for _, names in v.stages] == [
        ["embed", "lstm0"], ["lstm1"], ["lstm2"], ["lstm3", "decode"]]
    assert str(v) == text and Placement.parse(str(v), model) == v
    # the same layers on the same devices without the cut are another placement: one stage on vgpu1
    merged = Placement.parse("embed,lstm0:vgpu0 | lstm1-2:vgpu1 | lstm3,decode:vgpu0", model)
    assert merged.stage_devices == [0, 1, 0] and merged != v and merged.assignment == v.assignment


def test_v_shape_goes_down_the_devices_and_back(model):
    v = Placement.v_shape(model, 2)                      # 6 layers, 4 stages: 2 + 2 + 1 + 1
    assert v.stage_devices == [0, 1, 1, 0] and str(v) == "embed,lstm0:vgpu0 | lstm1-2:vgpu1 | lstm3:vgpu1 | decode:vgpu0"
    assert v == Placement.parse(str(v), model)
    three = Placement.v_shape(model, 3)
    assert three.stage_devices == [0, 1, 2, 2, 1, 0] and three.stages[0][1] == ["embed"]
    assert three.stages[-1] == (get_device("vgpu0"), ["decode"])   # embed and decode share device 0
    custom = Placement.v_shape(model, 2, sizes=[1, 1, 1, 3])
    assert [len(names) for _, names in custom.stages] == [1, 1, 1, 3]


@pytest.mark.parametrize("devices, sizes, message", [
    (4, None, "a V shape on 4 devices has 8 stages of at least one layer each, 6 layers in all; got sizes "
              r"\[1, 1, 1, 1, 1, 1, 0, 0\] \(the model has only 6 layers\)"),
    (2, [2, 2, 2], "a V shape on 2 devices has 4 stages"),
    (2, [3, 3, 0, 0], "got sizes"),
    (2, [1, 1, 1, 1], "6 layers in all")])
def test_v_shape_refusals_say_what_it_needs(model, devices, sizes, message):
    with pytest.raises(ValueError, match=message):
        Placement.v_shape(model, devices, sizes=sizes)


def test_a_cut_must_be_a_layer_after_the_first(model):
    with pytest.raises(ValueError, match=r"cuts \['embed'\] are not layers after the first"):
        Placement(model.layer_names, {n: "vgpu0" for n in model.layer_names}, cuts=["embed"])
