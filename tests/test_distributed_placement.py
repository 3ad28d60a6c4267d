"""mpedu.distributed.placement: device labels become pipeline ranks; placements that cannot run say why."""
import pytest

from conftest import tiny_model
from mpedu.distributed import rank_placement


def test_device_labels_become_ranks_in_order_of_appearance():
    model = tiny_model()   # embed, lstm0-2, decode
    placement = rank_placement(model, "embed,lstm0:vgpu1 | lstm1-2:cuda:0 | decode:vgpu1", 2)
    assert placement.stage_devices == [0, 1, 0]
    assert str(placement) == "embed,lstm0:rank0 | lstm1-2:rank1 | decode:rank0"
    assert rank_placement(model, None, 2).stage_devices == [0, 1]     # even split over the world
    assert rank_placement(model, "embed:cuda:0 | lstm0-2:b | decode:cuda0", 2).stage_devices == [0, 1, 0]


@pytest.mark.parametrize("text,world,words", [
    ("embed,lstm0:a | lstm1-2,decode:b", 3, "rank 2 would hold no layers"),
    ("embed:a | lstm0:b | lstm1-2,decode:c", 2, "--nproc-per-node 3"),
    (None, 6, "a rank with no layers"),
    ("embed,lstm0 vgpu0 | lstm1-2,decode:b", 2, "layers:device"),
    ("embed,lstm0:a | lstm0-2,decode:b", 2, "placed twice"),
    ("embed,lstm0-99:a | decode:b", 2, "wider than the model"),
])
def test_placement_errors_name_the_fix(text, world, words):
    with pytest.raises(ValueError, match=words):
        rank_placement(tiny_model(), text, world)


def test_tied_weights_cannot_span_ranks():
    model = tiny_model(num_layers=1, embed_size=64, tie_weights=True)
    with pytest.raises(ValueError, match="tied weights"):
        rank_placement(model, "embed:a | lstm0,decode:b", 2).check_tied_weights(model)
    rank_placement(model, "embed,lstm0,decode:a", 1).check_tied_weights(model)   # one rank: fine


def test_a_v_schedule_gets_the_v_placement_and_a_written_v_keeps_its_four_stages():
    model = tiny_model(num_layers=2)      # embed, lstm0, lstm1, decode
    for schedule in ("zbv", "DualPipeV"):
        placement = rank_placement(model, None, 2, schedule)
        assert placement.stage_devices == [0, 1, 1, 0], schedule                    # rank r: stages r, 2p-1-r
        assert [names for _, names in placement.stages] == [["embed"], ["lstm0"], ["lstm1"], ["decode"]]
    assert rank_placement(model, None, 2, "gpipe").stage_devices == [0, 1]          # others: the even split
    # two groups on one rank are two stages (they merged into one, and zbv then found no V)
    written = rank_placement(model, "embed:a | lstm0:b | lstm1:b | decode:a", 2)
    assert written.stage_devices == [0, 1, 1, 0]
    assert rank_placement(model, written, 2).stage_devices == [0, 1, 1, 0]          # a Placement keeps its cuts
    assert rank_placement(model, "embed:a | lstm0,lstm1:b | decode:a", 2).stage_devices == [0, 1, 0]
    with pytest.raises(ValueError, match="2 ranks in a V \\(2 stages each\\) but the model has only 3 layers"):
        rank_placement(tiny_model(num_layers=1), None, 2, "zbv")


def test_a_tied_model_runs_on_the_v_where_embed_and_decode_share_rank_0():
    model = tiny_model(num_layers=2, embed_size=64, tie_weights=True)
    rank_placement(model, None, 2, "zbv").check_tied_weights(model)            # stages 0 and 3 on rank 0
    with pytest.raises(ValueError, match="tied weights: embed \\(rank:0\\) and decode \\(rank:1\\)"):
        rank_placement(model, None, 2, "gpipe").check_tied_weights(model)      # the even split: refused as before
