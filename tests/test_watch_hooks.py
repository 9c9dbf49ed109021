"""Editor save hooks: the snippets, where --install writes them, and `tsdev reload --file` without a server."""
import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from tsdev import hooks
from tsdev.cli import app


def test_every_snippet_runs_reload_on_the_saved_file():
    for editor in hooks.EDITORS:
        hook = hooks.snippet(editor, url="http://127.0.0.1:9000")
        assert "reload" in hook.text and "--file" in hook.text and "http://127.0.0.1:9000" in hook.text, editor
    vscode = json.loads(hooks.snippet("vscode").text)["emeraldwalk.runonsave"]["commands"][0]
    assert vscode["match"] == "\\.py$" and vscode["cmd"].endswith('--file "${file}"') and vscode["isAsync"]
    options = {o.get("name"): o.get("value") for o in ET.fromstring(hooks.snippet("jetbrains").text).iter("option")}
    assert options["arguments"].endswith("reload --file $FilePath$") and options["fileExtension"] == "py"
    assert options["program"] == hooks.command()[0]
    lua = hooks.snippet("neovim").text
    assert 'nvim_create_autocmd("BufWritePost"' in lua and "jobstart" in lua and "nvim_buf_get_name(args.buf)" in lua
    elisp = hooks.snippet("emacs").text
    assert "(add-hook 'after-save-hook #'tsdev-reload-on-save)" in elisp and "make-process" in elisp
    assert elisp.count("(") == elisp.count(")")


def test_vscode_install_merges_into_existing_settings_once(tmp_path):
    settings = tmp_path / ".vscode" / "settings.json"
    settings.parent.mkdir()
    mine = {"match": "\\.md$", "cmd": "echo markdown"}
    settings.write_text(json.dumps({"editor.tabSize": 4, "emeraldwalk.runonsave": {"commands": [mine]}}))
    hooks.install("vscode", tmp_path)
    hooks.install("vscode", tmp_path)  # again: replaces ours, keeps the rest
    result = json.loads(settings.read_text())
    commands = result["emeraldwalk.runonsave"]["commands"]
    assert result["editor.tabSize"] == 4 and commands[0] == mine and len(commands) == 2
    assert "reload --file" in commands[1]["cmd"]


def test_vscode_install_refuses_settings_with_comments(tmp_path):
    (tmp_path / ".vscode").mkdir()
    (tmp_path / ".vscode" / "settings.json").write_text('{\n  // mine\n  "editor.tabSize": 4\n}\n')
    with pytest.raises(ValueError, match="not plain JSON"):
        hooks.install("vscode", tmp_path)


def test_neovim_install_goes_to_the_plugin_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert hooks.install("neovim", tmp_path) == [f"wrote {tmp_path}/config/nvim/plugin/tsdev.lua"]
    assert "BufWritePost" in (tmp_path / "config/nvim/plugin/tsdev.lua").read_text()


def test_emacs_install_loads_the_hook_from_the_init_file_once(tmp_path):
    home = tmp_path / "home"
    (home / ".emacs.d").mkdir(parents=True)
    (home / ".emacs.d" / "init.el").write_text("(setq inhibit-startup-screen t)")
    hooks.install("emacs", tmp_path, home=home)
    done = hooks.install("emacs", tmp_path, home=home)
    init = (home / ".emacs.d" / "init.el").read_text()
    assert init.startswith("(setq inhibit-startup-screen t)\n") and init.count("tsdev-reload.el") == 1
    assert done == [f"wrote {home}/.emacs.d/tsdev-reload.el"]  # the load line was already there
    assert "after-save-hook" in (home / ".emacs.d" / "tsdev-reload.el").read_text()


def test_jetbrains_install_writes_the_file_watcher_but_not_over_others(tmp_path):
    hooks.install("jetbrains", tmp_path)
    first = (tmp_path / ".idea" / "watcherTasks.xml").read_text()
    hooks.install("jetbrains", tmp_path)  # ours: rewritten, the same content (not appended to)
    assert (tmp_path / ".idea" / "watcherTasks.xml").read_text() == first
    assert ET.parse(tmp_path / ".idea" / "watcherTasks.xml").find(".//TaskOptions") is not None
    other = tmp_path / "other"
    (other / ".idea").mkdir(parents=True)
    (other / ".idea" / "watcherTasks.xml").write_text("<project><component name='ProjectTasksOptions'/></project>")
    with pytest.raises(FileExistsError, match="other file watchers"):
        hooks.install("jetbrains", other)


def test_hook_command_prints_and_rejects_unknown_editors():
    runner = CliRunner()
    result = runner.invoke(app, ["hook", "neovim"])
    assert result.exit_code == 0 and "BufWritePost" in result.output
    result = runner.invoke(app, ["hook", "notepad"])
    assert result.exit_code == 2 and "vscode, neovim, emacs, jetbrains" in result.output


def test_reload_file_outside_the_packages_is_a_quiet_no_op():
    result = CliRunner().invoke(app, ["reload", "--url", "http://127.0.0.1:9", "--file", "README.md"])
    assert result.exit_code == 0 and "nothing to reload" in result.output


def test_every_snippet_tells_needs_restart_and_failure_from_success():
    from tsdev.outcome import FAILED, NEEDS_RESTART, RELOADED

    assert (RELOADED, FAILED, NEEDS_RESTART) == (0, 1, 3)  # the exit statuses the snippets test for
    vscode = json.loads(hooks.snippet("vscode").text)["emeraldwalk.runonsave"]["commands"][0]
    assert vscode["autoShowOutputPanel"] == "error"  # any status but 0 opens the output
    lua = hooks.snippet("neovim").text
    assert "({ [0] = vim.log.levels.INFO, [3] = vim.log.levels.WARN })[code] or vim.log.levels.ERROR" in lua
    assert "(0 'success) (3 'warning) (_ 'error)" in hooks.snippet("emacs").text
    options = {o.get("name"): o.get("value") for o in ET.fromstring(hooks.snippet("jetbrains").text).iter("option")}
    assert options["exitCodeBehavior"] == "ERROR"  # any status but 0 opens the watcher's console
