from tsdev.cli import app

app(prog_name="tsdev")
