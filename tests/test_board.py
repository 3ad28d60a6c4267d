"""The layer board's front end: it reads only the traits Python syncs, fetches nothing, and its text is legible."""
import re

import pytest

pytest.importorskip("anywidget")

from mpedu.course import BOARD_CSS, BOARD_ESM, LayerBoard  # noqa: E402


def test_the_page_reads_every_synced_trait_and_no_other():
    read = set(re.findall(r'model\.get\("(\w+)"\)', BOARD_ESM))
    for names in re.findall(r"\[([^\]]*)\]\.map\(\(n\) => model\.get\(n\)\)|const names = \[([^\]]*)\]", BOARD_ESM):
        read |= set(re.findall(r'"(\w+)"', "".join(names)))
    assert read == set(LayerBoard.class_own_traits(sync=True))


def test_a_drop_sends_back_the_assignment_python_reads():
    board = LayerBoard(layers=["embed", "decode"], devices=["vgpu:0", "vgpu:1"],
                       assignment={"embed": "vgpu:0", "decode": "vgpu:0"})
    assert 'model.set("assignment", a)' in BOARD_ESM and "model.save_changes()" in BOARD_ESM
    seen = []
    board.observe(lambda change: seen.append(change["new"]), "assignment")
    board.set_state({"assignment": {"embed": "vgpu:0", "decode": "vgpu:1"}})   # what the front end's save sends
    assert seen == [{"embed": "vgpu:0", "decode": "vgpu:1"}]


def test_the_board_front_end_fetches_nothing():
    code = BOARD_ESM + BOARD_CSS
    assert "http" not in code and "import " not in code
    assert "@import" not in BOARD_CSS


def test_board_text_is_at_least_11_pixels():
    sizes = [int(s) for s in re.findall(r"font-size:\s*(\d+)px", BOARD_CSS)]
    assert sizes and min(sizes) >= 11
