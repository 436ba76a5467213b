"""The package layout keeps its promises: decoding never imports training, and the CLI answers
--help and argument errors without importing torch (checked in fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys

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
