"""The set-up files agree: environment.yml, pyproject.toml, requirements.lock, README and CI."""
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
