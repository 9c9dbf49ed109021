"""How tsdev's commands print their help and usage lines (`tsdev.cli`'s app and `tsdev weights`'s)."""
import typer
from typer.core import TyperCommand

_NO_BREAK = "\u2011"  # a non-breaking hyphen while wrapping: `--max-batched-tokens` stays on one line


class HelpFormatter(TyperCommand.context_class.formatter_class):
    """click's plain help formatter, except that it never breaks a line inside a hyphenated word."""

    def write_text(self, text: str) -> None:
        super().write_text(text.replace("-", _NO_BREAK))

    def write_dl(self, rows, *args, **kwargs) -> None:
        super().write_dl([(term, help.replace("-", _NO_BREAK)) for term, help in rows], *args, **kwargs)

    def getvalue(self) -> str:
        return super().getvalue().replace(_NO_BREAK, "-")


class Context(TyperCommand.context_class):
    formatter_class = HelpFormatter


class Command(TyperCommand):
    context_class = Context

    def collect_usage_pieces(self, ctx) -> list[str]:
        """click's usage line: a required argument as NAME, an optional one as [NAME] (typer writes {name} and [name]:
        `tsdev weights update [OPTIONS] {path}` read as a placeholder to type with its braces)."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                pieces += param.get_usage_pieces(ctx)
                continue
            name = param.metavar or param.name.upper()
            pieces.append((name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else ""))
        return pieces


class Typer(typer.Typer):
    """typer's Typer whose commands are `Command`s."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or Command, **kwargs)
