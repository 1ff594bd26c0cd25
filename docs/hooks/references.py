"""MkDocs hook: the command line and Python API references, generated from the code.

A page holding ``<!-- cli-reference -->`` gets, in its place, one section per command of
``tierflow.cli.main.build_parser()``: its description, its usage and a table of its options
with their help. ``cli_markdown()`` is what the hook inserts (the tests call it too). A page holding
``<!-- api-reference -->`` gets one mkdocstrings block per name of ``tierflow.__all__``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
SRC = Path(__file__).resolve().parents[2] / "src"


def _parser() -> argparse.ArgumentParser:
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    from tierflow.cli.main import build_parser
    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{name: parser}`` of every subcommand, in the order ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices.items())
    return {}


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options and positionals a user may pass (not ``--help``)."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    metavar = ""
    if action.nargs != 0:
        if action.choices is not None and action.metavar is None:
            metavar = " {" + ",".join(map(str, action.choices)) + "}"
        else:
            metavar = f" {action.metavar or action.dest.upper()}"
    return ", ".join(f"`{name}{metavar}`" for name in action.option_strings)


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%(" in text:
        values = dict(vars(action), prog=parser.prog)
        values.update(default=action.default)
        try:
            text = text % values
        except (KeyError, TypeError, ValueError):
            pass
    return text


def cli_markdown() -> str:
    """Markdown for every command: description, usage, options."""
    root = _parser()
    parts = []
    for name, parser in subcommands(root).items():
        parts.append(f"## tierflow {name}\n")
        if parser.description:
            parts.append(_cell(parser.description) + "\n")
        usage = parser.format_usage().strip().removeprefix("usage: ")
        parts.append(f"```text\n{usage}\n```\n")
        parts.append("| option | help |\n|---|---|")
        for action in options(parser):
            parts.append(f"| {_names(action)} | {_cell(_help(action, parser))} |")
        parts.append("")
    return "\n".join(parts)




API_MARKER = "<!-- api-reference -->"


def api_names() -> list[tuple[str, str]]:
    """``(name, dotted path where it is defined)`` of every name ``tierflow.__all__`` exports
    but ``__version__``, in its order."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    import tierflow
    found = []
    for name in tierflow.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(tierflow, name)
        found.append((name, f"{obj.__module__}.{obj.__qualname__}"))
    return found


def api_markdown() -> str:
    """One mkdocstrings block per exported name, titled by the name users write."""
    return "\n".join(f"## tierflow.{name}\n\n::: {path}\n    options:\n"
                     f"      show_root_heading: false\n" for name, path in api_names())


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs hook)
    """Put the generated references where their markers are."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_markdown())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_markdown())
    return markdown
