"""The command-line reference page (docs/reference/cli.md), rendered from the `draftline` argparse parser itself;
draftline.docs_reference writes it with the other generated pages."""
from __future__ import annotations

import argparse

_REGENERATE = "python -m draftline.docs_reference"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments a user types: neither --help nor the subcommand slot."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return str(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest if not action.option_strings else action.dest.upper()


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _repeats(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._AppendAction, argparse._ExtendAction, argparse._CountAction))


def _form(action: argparse.Action) -> str:
    """How the argument is written: `config`, `--store STORE`, `--quiet`."""
    if not action.option_strings:
        return _metavar(action)
    flag = max(action.option_strings, key=len)
    return f"{flag} {_metavar(action)}" if _takes_value(action) else flag


def _synopsis(prog: str, parser: argparse.ArgumentParser) -> str:
    parts = [prog]
    for action in _arguments(parser):
        form = _form(action)
        if action.option_strings and not action.required:
            form = f"[{form}]"
        parts.append(form + ("..." if _repeats(action) else ""))
    if _subcommands(parser):
        parts.append(next(a.metavar or "COMMAND" for a in parser._actions
                          if isinstance(a, argparse._SubParsersAction)) + " ...")
    return " ".join(parts)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": prog}
    notes = []
    if action.required and action.option_strings:
        notes.append("required")
    if _repeats(action) and "repeat" not in text:
        notes.append("repeatable")
    default = action.default
    if (action.option_strings and _takes_value(action) and default not in (None, [], argparse.SUPPRESS)
            and "default" not in text):
        notes.append(f"default: {default}")
    return "; ".join([text] + notes) if text else "; ".join(notes)


def _anchor(prog: str) -> str:
    return prog.replace(" ", "-")


def _prose(text: str) -> str:
    """Help text as markdown prose: angle brackets shown, not read as HTML tags."""
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _cell(text: str) -> str:
    return _prose(text).replace("|", "\\|").replace("\n", " ")


def _section(prog: str, parser: argparse.ArgumentParser, out: list[str]) -> None:
    subs = _subcommands(parser)
    out += [f"## `{prog}`", ""]
    if parser.description:
        out += [_prose(parser.description[0].upper() + parser.description[1:]) + ".", ""]
    out += ["```", _synopsis(prog, parser), "```", ""]
    arguments = _arguments(parser)
    if arguments:
        out += ["| Argument | What it does |", "|---|---|"]
        out += [f"| `{_form(a)}` | {_cell(_help(a, prog))} |" for a in arguments]
        out.append("")
    if subs:
        out += ["| Action | What it does |", "|---|---|"]
        out += [f"| [`{name}`](#{_anchor(f'{prog} {name}')}) | {_cell(text)} |" for name, text, _ in subs]
        out.append("")
    for name, _, sub in subs:
        _section(f"{prog} {name}", sub, out)


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The page, in markdown: every command, subcommand and argument with its help, in the parser's order."""
    if parser is None:
        from draftline.cli import build_parser

        parser = build_parser()
    prog = parser.prog
    out = ["# Command-line reference", "",
           f"<!-- Generated from the parser in draftline/cli.py by `{_REGENERATE}`: edit the help there, "
           "not this page. -->", ""]
    if parser.description:
        out += [_prose(parser.description), ""]
    out += ["Every command takes `-h` / `--help`, which prints what this page says about it.", ""]
    out += ["| Command | What it does |", "|---|---|"]
    out += [f"| [`{prog} {name}`](#{_anchor(f'{prog} {name}')}) | {_cell(text)} |"
            for name, text, _ in _subcommands(parser)]
    out.append("")
    if parser.epilog:
        out += [_prose(parser.epilog), ""]
    for name, _, sub in _subcommands(parser):
        _section(f"{prog} {name}", sub, out)
    return "\n".join(out).rstrip("\n") + "\n"
