"""Every argparse help string in the package and in `benchmarks/` survives argparse's own
expansion (`help % params`): a bare `%` in one makes `--help` raise instead of printing."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("src/tierflow/**/*.py")])


class _AnyParam(dict):
    """What argparse hands `%`: every action attribute by name (any name answers here)."""

    def __missing__(self, key: str) -> str:
        return ""


def _help_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every constant string given as `help=` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.keyword) and node.arg == "help":
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                found.append((node.value.lineno, node.value.value))
    return found


def test_the_scan_finds_help_strings():
    assert sum(len(_help_strings(path)) for path in SOURCES) > 100


def test_help_strings_expand():
    broken = []
    for path in SOURCES:
        for line, text in _help_strings(path):
            try:
                text % _AnyParam()
            except (TypeError, ValueError, KeyError) as error:
                broken.append(f"{path.relative_to(ROOT)}:{line}: {text!r} ({error})")
    assert not broken, "help strings argparse cannot expand (write a literal % as %%):\n" + \
        "\n".join(broken)
