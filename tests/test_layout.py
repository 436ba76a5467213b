"""The package layout keeps its promises: decoding never imports training, and the CLI answers
--help and argument errors without importing torch (checked in fresh interpreters)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


def _modules_after(code: str) -> set[str]:
    """The modules loaded after ``code`` in a fresh interpreter (reported on stderr, apart from its output)."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('MODULES', *sys.modules, file=sys.stderr)"],
                         capture_output=True, text=True, check=True, timeout=300)
    return set(out.stderr.split("MODULES", 1)[1].split())


@pytest.mark.parametrize("module", ["omnidraft.decode", "omnidraft.drafter", "omnidraft.runtime", "omnidraft.adapter.slot"])
def test_decoding_does_not_import_training(module):
    loaded = _modules_after(f"import {module}")
    assert module in loaded and "torch" in loaded  # the check would see an import if there were one
    assert not [m for m in loaded if m.startswith("omnidraft.train")]
    assert not [m for m in loaded if m.startswith("omnidraft.experiments")]


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["chat", "--help"], ["bench", "--help"],
                                  ["adapt", "--help"], ["experiment", "online", "--help"], ["generate", "--temperature", "nan"]])
def test_the_cli_answers_without_torch(argv):
    code = ("from omnidraft.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass")
    loaded = _modules_after(code)
    assert "omnidraft.cli" in loaded and "torch" not in loaded and "transformers" not in loaded


def test_one_temperature_default_everywhere():
    """The same option has the same default in every subcommand that takes it (--n and --stream-n
    count different things in bench, adapt and the experiments; chat's --home defers to the global one)."""
    from omnidraft.cli import build_parser

    parser = build_parser()
    defaults: dict[str, set] = {}

    def walk(p):
        for action in p._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict) and action.option_strings == []:
                for name, sub in action.choices.items():
                    if name != "export":  # its --target/--adapter/--out name what to export, not what to run
                        walk(sub)
            elif action.option_strings and action.dest not in ("help", "interval"):
                defaults.setdefault(action.option_strings[0], set()).add(repr(action.default))

    walk(parser)
    assert defaults["--temperature"] == {"0.0"} and defaults["--max-new-tokens"] == {"256"}
    differing = {flag: d for flag, d in defaults.items() if len(d) > 1 and flag not in ("--n", "--stream-n", "--home")}
    assert differing == {}, differing


def _package_imports() -> dict[str, set[str]]:
    """omnidraft's import graph between its packages and top-level modules ("omnidraft.vocab",
    "omnidraft.decode", …): every import a module runs, at its top or inside a function; imports
    under ``if TYPE_CHECKING:`` are annotations only and are left out."""
    import ast

    import omnidraft

    root = Path(omnidraft.__file__).parent
    units = {p.stem if p.suffix == ".py" else p.name for p in root.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        if rel[0] not in units and rel[0].removesuffix(".py") not in units:
            continue
        source = "omnidraft." + rel[0].removesuffix(".py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "omnidraft" and len(parts) > 1 and parts[1] in units and parts[1] != source.split(".")[1]:
                    graph.setdefault(source, set()).add("omnidraft." + parts[1])
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return None

    return next((c for c in (visit(n, []) for n in sorted(graph)) if c), None)


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_packages():
    """Each package (and top-level module) can be read, tested and replaced knowing only what it
    imports: no two of them import each other, directly or around a loop."""
    graph = _package_imports()
    assert "omnidraft.decode" in graph and "omnidraft.sources" in graph["omnidraft.decode"]  # the graph is real
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_built_wheel_carries_every_file_the_package_reads(tmp_path):
    """An install from a wheel (``pip install .``, not the editable set-up) compiles the native kernels
    from their sources on first use and loads the gRPC schema at import: files that are not Python and
    that setuptools leaves out unless told. Every tracked non-Python file under the package must be in it."""
    root = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "omnidraft"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:  # a copy of the tracked files: no build folders in the working tree
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, tmp_path / "src" / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel"), str(tmp_path / "src")], check=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    data = [n for n in tracked if n.startswith("omnidraft/") and not n.endswith(".py")]
    assert data and "omnidraft/kernels/qdraft.cpp" in data
    assert [n for n in data if n not in packed] == []
