"""The set-up files agree: environment.yml, pyproject.toml, requirements.lock, README (its course map too) and CI."""
import json
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}   # conda-forge names that differ from PyPI's


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement.strip(), maxsplit=1)[0].lower()


def _pyproject_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        names |= {_name(r) for r in extra}
    return names


def test_environment_yml_names_the_same_packages_as_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {CONDA_NAMES.get(_name(d), _name(d)) for d in env["dependencies"] if isinstance(d, str)}
    conda -= {"python", "pip"}
    assert conda == _pyproject_names(), (
        f"only in environment.yml: {sorted(conda - _pyproject_names())}; "
        f"only in pyproject.toml: {sorted(_pyproject_names() - conda)}")


def test_lock_pins_every_dependency_and_torch_2_13():
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements.lock line {line!r} is not pinned with =="
            pins[name.lower().replace("_", "-")] = version
    assert pins["torch"] == "2.13.0"
    missing = {n.replace("_", "-") for n in _pyproject_names()} - set(pins)
    assert not missing, f"requirements.lock lacks {sorted(missing)}"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./run.sh test" in readme and "./run.sh train" in readme
    commands = [line for line in ci.splitlines() if line.strip() and not line.startswith("#")
                and not line.startswith(("set ", "cd ", "export "))]
    assert commands == ["exec ./run.sh test"]


def _course_map() -> list[tuple[str, str]]:
    """The README's course table, in order: (link text, path) per row, e.g. ("03 pipelining", "notebooks/03_...")."""
    section = (ROOT / "README.md").read_text().split("\n## The course\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| \[([^\]]+)\]\(([^)]+)\) \|", section, flags=re.MULTILINE)


def _first_heading(notebook: Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "markdown")
    return "".join(first["source"]).splitlines()[0]


def test_readme_course_map_links_every_notebook_once_in_order():
    rows = _course_map()
    linked = [ROOT / path for _, path in rows]
    missing = [str(p.relative_to(ROOT)) for p in linked if not p.exists()]
    assert not missing, f"the README's course map links notebooks that do not exist: {missing}"
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert linked == notebooks, (
        f"the README's course map {[p.name for p in linked]} must list every notebook once, in order: "
        f"{[p.name for p in notebooks]}")


def test_readme_course_titles_are_the_notebooks_first_headings():
    # "03 pipelining" names "# 4 · Pipelining: micro-batches and GPipe": the number, then the heading's start.
    for title, path in _course_map():
        number, _, words = title.partition(" ")
        heading = _first_heading(ROOT / path)
        expected = f"# {int(number)} · {words}"
        assert heading.lower().startswith(expected.lower()), (
            f"README course map says {title!r} for {path}, whose first heading is {heading!r}")


def test_readme_links_the_one_page_summary_from_the_course_section():
    section = (ROOT / "README.md").read_text().split("\n## The course\n", 1)[1].split("\n## ", 1)[0]
    assert "(docs/summary.md)" in section and (ROOT / "docs" / "summary.md").exists()


def test_every_link_between_notebooks_and_docs_exists():
    # "Next: [4 · Pipelining](04_pipelining.ipynb)" and the like, in every notebook's markdown and in the docs.
    broken = []
    for page in [*sorted((ROOT / "notebooks").glob("*.ipynb")), *sorted((ROOT / "docs").glob("*.md"))]:
        if page.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(page.read_text())["cells"]
                              if c["cell_type"] == "markdown")
        else:
            text = page.read_text()
        for target in re.findall(r"\]\(([^)#:\s]+\.(?:ipynb|md))\)", text):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"
