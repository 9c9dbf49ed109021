"""Every command's usage line names its arguments as click does: PATH when required, [MODEL] when not (typer's
`{path}` read as a placeholder to type with its braces)."""
from typer.testing import CliRunner

from tsdev.cli import app


def test_usage_lines_name_arguments_in_capitals_without_braces():
    usages = {command: CliRunner().invoke(app, [*command.split(), "--help"], prog_name="tsdev").output.splitlines()[0]
              for command in ("serve", "hook", "check", "weights update", "weights reload", "weights drill")}
    assert usages == {"serve": "Usage: tsdev serve [OPTIONS] [MODEL]", "hook": "Usage: tsdev hook [OPTIONS] EDITOR",
                      "check": "Usage: tsdev check [OPTIONS] [OPS]...",
                      "weights update": "Usage: tsdev weights update [OPTIONS] PATH",
                      "weights reload": "Usage: tsdev weights reload [OPTIONS] [PATH]",
                      "weights drill": "Usage: tsdev weights drill [OPTIONS] [MODEL]"}
