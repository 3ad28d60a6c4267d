"""The course's notebooks as nbval sees them: timing cells tagged, nothing else hidden, deterministic times compared."""
import configparser
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IGNORE = "nbval-ignore-output"


def _sanitisers() -> list[tuple[re.Pattern, str]]:
    # nbval's file format: sections of "regex:" and "replace:" lines
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "notebooks" / "sanitize.cfg")
    return [(re.compile(config[s]["regex"]), config[s]["replace"]) for s in config.sections()]


def _sanitise(text: str) -> str:
    for pattern, replacement in _sanitisers():
        text = pattern.sub(replacement, text)
    return text


def _code_cells(path: Path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            outputs = []
            for out in cell.get("outputs", []):
                text = out.get("text") or out.get("data", {}).get("text/plain", "")
                outputs.append("".join(text) if isinstance(text, list) else str(text))
            yield "".join(cell["source"]), cell.get("metadata", {}).get("tags", []), "\n".join(outputs)


def test_the_sanitiser_keeps_simulator_times_and_evens_out_float_noise():
    # Times from the simulator are the same on every machine: nbval must compare them (issue 12).
    line = "GPipe                    33.0 ms   27.3%   8  8  8  8"
    assert _sanitise(line) == line
    assert _sanitise("wavefront 4.13 ms, 880 us, 1,234 tokens/s") == "wavefront 4.13 ms, 880 us, 1,234 tokens/s"
    assert _sanitise("loss 8.1100923") == _sanitise("loss 8.1100917") == "loss 8.1100"
    assert _sanitise("<Worker at 0x7f3a2b1c4d50>") == "<Worker at 0xADDRESS>"
    # a check's gradient difference from one device is rounding, another on each CPU; its words stay compared
    assert _sanitise("equal one device's (max difference 7e-09)") == "equal one device's (max difference ROUNDING)"
    assert _sanitise("max difference 0e+00") == "max difference ROUNDING"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_learners_see_no_test_markers_in_code(path):
    # nbval reads the nbval-ignore-output tag; a comment in the code would be noise for a learner (issue 18).
    for source, _, _ in _code_cells(path):
        assert "NBVAL_" not in source, f"{path.name}: use the {IGNORE!r} cell tag, not a comment:\n{source[:200]}"
        assert "# noqa" not in source, f"{path.name}: a linter comment in a learner's code cell:\n{source[:200]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_with_measured_output_is_tagged(path):
    # Free cores and timing verdicts (they name the free cores) change from run to run: nbval must not compare them.
    for source, tags, output in _code_cells(path):
        if "free cores" in output:
            assert IGNORE in tags, f"{path.name}: this cell prints measured free cores but is compared:\n{source[:300]}"
