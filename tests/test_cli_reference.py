"""docs/reference/cli.md is rendered from the `draftline` parser: it names every command and argument with its help,
and a page that no longer matches the parser fails here and in `python -m draftline.docs_reference --check`."""
from __future__ import annotations

import argparse

from draftline import cli_reference, docs_reference
from draftline.cli import build_parser


def _commands(parser: argparse.ArgumentParser, prog: str = "draftline"):
    """(prog, parser) of every command and subcommand, depth first."""
    for name, _, sub in cli_reference._subcommands(parser):
        yield f"{prog} {name}", sub
        yield from _commands(sub, f"{prog} {name}")


def test_the_committed_page_is_what_the_parser_renders():
    assert docs_reference.CLI_PAGE not in docs_reference.stale_pages(), \
        "run `python -m draftline.docs_reference` and commit docs/reference/cli.md"


def test_the_page_names_every_command_and_argument_with_its_help():
    page = cli_reference.render()
    commands = list(_commands(build_parser()))
    assert {prog for prog, _ in commands} >= {"draftline run", "draftline config validate", "draftline config init"}
    for prog, parser in commands:
        assert f"## `{prog}`" in page and f"(#{prog.replace(' ', '-')})" in page
        for action in cli_reference._arguments(parser):
            assert f"`{cli_reference._form(action)}`" in page, (prog, action.dest)
            assert cli_reference._cell(action.help.split(";")[0]) in page, (prog, action.dest)
    assert "draftline config init --target PATH [--gpus N] [--engine {vllm,sglang}]... [--out FILE]" in page
    assert "`--set KEY.PATH=VALUE`" in page and "repeatable" in page
    assert "&lt;store&gt;/&lt;run&gt;" in page  # angle brackets in help shown as text, not swallowed as HTML


def test_the_page_does_not_depend_on_the_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = cli_reference.render()
    monkeypatch.setenv("COLUMNS", "300")
    assert cli_reference.render() == narrow


def test_check_fails_on_a_stale_page_and_passes_once_it_is_rewritten(tmp_path, capsys):
    page = tmp_path / docs_reference.CLI_PAGE
    assert docs_reference.main(["--root", str(tmp_path)]) == 0 and page.read_text() == cli_reference.render()
    assert docs_reference.main(["--check", "--root", str(tmp_path)]) == 0
    page.write_text(page.read_text().replace("override one field of the config", "override a field"))
    assert docs_reference.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"{docs_reference.CLI_PAGE} is stale: it differs from what the code generates; "
                           "regenerate it with: python -m draftline.docs_reference")
