"""The package's layers, read from the source (ast; nothing is imported, torch neither):

    runtime < pictures < lm < core < predict < training < course < cli < distributed

A module may import its own subpackage and the layers before its own, never one after it (an
upward import) — wherever the import stands, at the top or inside a function. The notebooks and
the benchmarks use the public faces only: `mpedu` and `mpedu.<layer>`, names that face lists in
`__all__`. Tests may reach a module's private helpers (`_name`) by the module's path."""
import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mpedu"
LAYERS = ["runtime", "pictures", "lm", "core", "predict", "training", "course", "cli", "distributed"]
TOP = {"__init__", "__main__"}      # mpedu/__init__.py and mpedu/__main__.py may use every layer


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every mpedu import in the file, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            if node.module:
                found.append((node.lineno, ".".join(base + [node.module])))
            else:        # from . import a, b: each name is a module (or a name) of that package
                found += [(node.lineno, ".".join(base + [alias.name])) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mpedu":
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "mpedu"]
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(root: pathlib.Path = PACKAGE) -> list[str]:
    wrong = []
    for path in sorted(root.rglob("*.py")):
        here = layer_of(module_name(path))
        if here is None:
            continue
        for line, target in imports_of(path):
            there = layer_of(target)
            if there is None and target.split(".") != ["mpedu"]:
                continue        # a top-level name of mpedu itself is checked below
            if there is None or LAYERS.index(there) > LAYERS.index(here):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {target} "
                             f"({there or 'the mpedu package, which gathers every layer'})")
    return wrong


def test_every_module_lives_in_a_layer():
    loose = [p.name for p in PACKAGE.glob("*.py") if p.stem not in TOP]
    assert loose == [], f"put {loose} into one of {LAYERS} (DEVELOPERS.md says which)"
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == sorted(LAYERS), f"a subpackage this test does not place: {set(folders) - set(LAYERS)}"


def test_no_layer_imports_a_layer_above_it():
    assert upward_imports() == []


def test_the_check_finds_an_upward_import(tmp_path):
    # a copy of the package with one import added where it does not belong: the check must name it
    copy = tmp_path / "mpedu"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    stage = copy / "core" / "stage.py"
    stage.write_text(stage.read_text() + "\n\ndef _late():\n    from ..predict import simulate  # noqa\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        wrong = upward_imports(copy)
    finally:
        ROOT = saved
    assert len(wrong) == 1 and "mpedu/core/stage.py" in wrong[0] and "mpedu.predict" in wrong[0], wrong


def faces() -> dict[str, set[str]]:
    """Each public face's __all__, read from its source."""
    out = {}
    for name in ["mpedu"] + [f"mpedu.{layer}" for layer in LAYERS]:
        init = ROOT / name.replace(".", "/") / "__init__.py"
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                out[name] = set(ast.literal_eval(node.value))
    return out


def face_violations(source: str, where: str, known: dict[str, set[str]], internals: bool = False) -> list[str]:
    """Imports past the faces. With `internals` (tests), a module may be imported by its path, and its
    private helpers (`from mpedu.lm.data import _count_tokens`) too."""
    wrong = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mpedu":
            private = all(alias.name.startswith("_") for alias in node.names)
            if node.module not in known and internals and private:
                continue
            if node.module not in known:
                wrong.append(f"{where}: from {node.module} import ... (use mpedu or mpedu.<layer>)")
                continue
            wrong += [f"{where}: {alias.name} is not in {node.module}.__all__" for alias in node.names
                      if alias.name not in known[node.module]]
        elif isinstance(node, ast.Import):
            wrong += [f"{where}: import {alias.name} (use mpedu or mpedu.<layer>)" for alias in node.names
                      if alias.name.split(".")[0] == "mpedu" and alias.name not in known and not internals]
    return wrong


def notebook_code(path: pathlib.Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    lines = [line for cell in cells if cell["cell_type"] == "code" for line in "".join(cell["source"]).split("\n")]
    return "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))   # IPython magics


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "bench").glob("*.py")),
                         ids=lambda p: p.name)
def test_notebooks_and_benchmarks_use_the_public_faces(path):
    source = notebook_code(path) if path.suffix == ".ipynb" else path.read_text()
    assert face_violations(source, path.name, faces()) == []


def test_tests_import_public_names_through_the_faces():
    known, wrong = faces(), []
    for path in sorted((ROOT / "tests").glob("*.py")):
        wrong += face_violations(path.read_text(), path.name, known, internals=True)
    assert wrong == []


def test_the_face_check_names_an_internal_path():
    known = faces()
    assert face_violations("from mpedu.core.pipeline import Pipeline", "nb", known) == [
        "nb: from mpedu.core.pipeline import ... (use mpedu or mpedu.<layer>)"]
    assert face_violations("from mpedu.core import Nonesuch", "nb", known) == ["nb: Nonesuch is not in mpedu.core.__all__"]
    assert face_violations("from mpedu.lm.data import _count_tokens", "test", known, internals=True) == []
    assert face_violations("from mpedu.lm.data import Corpus", "test", known, internals=True) != []
