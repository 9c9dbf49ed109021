"""Editor save hooks: run `tsdev reload --file PATH` whenever a Python file is saved.

`tsdev watch` already reloads on every save; hooks are for when file events do not reach it (a network
or container filesystem, an editor on another machine) or when no daemon runs at all. Reloads they
trigger show up in the watch screen through the server's event stream. Each hook runs the command in
the background and shows its answer, marked by its exit status: reloaded (0), needs a restart (3), failed
(1), no server (2) (tsdev/outcome.py); `tsdev reload --file` ignores files outside the reloadable packages'
projects, so hooks may fire on every save.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from tsdev.client import DEFAULT_URL
from tsdev.outcome import NEEDS_RESTART, RELOADED

EDITORS = ("vscode", "neovim", "emacs", "jetbrains")
MARK = "tsdev hook"  # found in every snippet: re-installing replaces ours and nothing else


def command(url: str | None = None) -> list[str]:
    """The reload command with absolute paths (editors do not see the shell's PATH or virtualenv): this
    interpreter's tsdev, not whichever `tsdev` comes first on PATH."""
    return [sys.executable, "-m", "tsdev", "reload", *(["--url", url] if url and url != DEFAULT_URL else []), "--file"]


@dataclass
class Hook:
    where: str  # where it goes, in words
    text: str
    note: str = ""


def _lua_list(items: list[str]) -> str:
    return ", ".join(json.dumps(i) for i in items)


def _elisp_list(items: list[str]) -> str:
    return " ".join(json.dumps(i) for i in items)


def snippet(editor: str, url: str | None = None) -> Hook:
    cmd = command(url)
    if editor == "vscode":
        settings = {"emeraldwalk.runonsave": {"commands": [
            {"match": "\\.py$", "isAsync": True, "cmd": f"{shlex.join(cmd)} \"${{file}}\"",
             "message": "tsdev: reloading the server's forward pass",
             "autoShowOutputPanel": "error"}]}}  # any exit status but 0: needs restart, failed, no server
        return Hook(".vscode/settings.json in the project (merge the key into existing settings)",
                    json.dumps(settings, indent=4),
                    "needs the Run on Save extension: code --install-extension emeraldwalk.RunOnSave")
    if editor == "neovim":
        return Hook("~/.config/nvim/plugin/tsdev.lua (every file in plugin/ is loaded at startup)", f"""\
-- {MARK} neovim: reload the tsdev server's forward pass when a Python file is saved
vim.api.nvim_create_autocmd("BufWritePost", {{
  pattern = "*.py",
  group = vim.api.nvim_create_augroup("tsdev_reload", {{ clear = true }}),
  callback = function(args)
    local out = {{}}
    local function collect(_, data) vim.list_extend(out, data) end
    vim.fn.jobstart({{ {_lua_list(cmd)}, vim.api.nvim_buf_get_name(args.buf) }}, {{
      stdout_buffered = true, stderr_buffered = true, on_stdout = collect, on_stderr = collect,
      on_exit = function(_, code)
        local msg = vim.trim(table.concat(out, "\\n"))
        local level = ({{ [{RELOADED}] = vim.log.levels.INFO, [{NEEDS_RESTART}] = vim.log.levels.WARN }})[code] \
or vim.log.levels.ERROR
        if msg ~= "" then vim.notify("tsdev: " .. msg, level) end
      end,
    }})
  end,
}})
""")
    if editor == "emacs":
        return Hook("tsdev-reload.el in your Emacs directory, loaded from your init file", f"""\
;;; tsdev-reload.el --- {MARK} emacs: reload the tsdev server's forward pass when a Python file is saved
(require 'subr-x)
(defun tsdev-reload-on-save ()
  "Run `tsdev reload --file' on the saved Python file in the background; show its answer."
  (when (and buffer-file-name (string-suffix-p ".py" buffer-file-name))
    (let ((buf (get-buffer-create " *tsdev reload*")))
      (with-current-buffer buf (erase-buffer))
      (make-process
       :name "tsdev-reload" :buffer buf :noquery t
       :command (list {_elisp_list(cmd)} buffer-file-name)
       :sentinel (lambda (proc _event)
                   (unless (process-live-p proc)
                     (message "tsdev: %s"
                              (propertize (with-current-buffer (process-buffer proc) (string-trim (buffer-string)))
                                          'face (pcase (process-exit-status proc)
                                                  ({RELOADED} 'success) ({NEEDS_RESTART} 'warning) (_ 'error))))))))))
(add-hook 'after-save-hook #'tsdev-reload-on-save)
(provide 'tsdev-reload)
""")
    if editor == "jetbrains":
        args = shlex.join(cmd[1:]) + " $FilePath$"
        return Hook(".idea/watcherTasks.xml in the project (Settings | Tools | File Watchers)", f"""\
<?xml version="1.0" encoding="UTF-8"?>
<!-- {MARK} jetbrains: reload the tsdev server's forward pass when a Python file is saved -->
<project version="4">
  <component name="ProjectTasksOptions">
    <TaskOptions isEnabled="true">
      <option name="arguments" value="{_xml(args)}" />
      <option name="checkSyntaxErrors" value="false" />
      <option name="description" value="tsdev: reload the server's forward pass on save" />
      <option name="exitCodeBehavior" value="ERROR" />
      <option name="fileExtension" value="py" />
      <option name="immediateSync" value="false" />
      <option name="name" value="tsdev reload" />
      <option name="output" value="" />
      <option name="outputFilters">
        <array />
      </option>
      <option name="outputFromStdout" value="false" />
      <option name="program" value="{_xml(cmd[0])}" />
      <option name="runOnExternalChanges" value="false" />
      <option name="scopeName" value="Project Files" />
      <option name="trackOnlyRoot" value="false" />
      <option name="workingDir" value="$ProjectFileDir$" />
      <envs />
    </TaskOptions>
  </component>
</project>
""", "File Watchers is bundled with PyCharm Professional and IntelliJ IDEA Ultimate; install it from "
     "Marketplace in the Community editions. It runs on explicit and automatic saves.")
    raise ValueError(f"unknown editor {editor!r}: one of {', '.join(EDITORS)}")


def _xml(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")


def install(editor: str, project: Path, url: str | None = None, home: Path | None = None) -> list[str]:
    """Write the hook where the editor reads it; returns what was done, one line each."""
    hook, home = snippet(editor, url), home or Path.home()
    if editor == "vscode":
        return [_install_vscode(project / ".vscode" / "settings.json", hook)]
    if editor == "neovim":
        config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        return [_write(config / "nvim" / "plugin" / "tsdev.lua", hook.text)]
    if editor == "emacs":
        return _install_emacs(home, hook)
    if editor == "jetbrains":
        path = project / ".idea" / "watcherTasks.xml"
        if path.exists() and MARK not in path.read_text():
            raise FileExistsError(f"{path} already holds other file watchers: add this one in Settings | Tools | "
                                  "File Watchers, or merge the TaskOptions block from `tsdev hook jetbrains` into it")
        return [_write(path, hook.text)]
    raise ValueError(f"unknown editor {editor!r}: one of {', '.join(EDITORS)}")


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return f"wrote {path}"


def _install_vscode(path: Path, hook: Hook) -> str:
    settings = {}
    if path.exists() and path.read_text().strip():
        try:
            settings = json.loads(path.read_text())
        except ValueError:
            raise ValueError(f"{path} is not plain JSON (comments?): add the \"emeraldwalk.runonsave\" key from "
                             "`tsdev hook vscode` to it yourself") from None
    ours = json.loads(hook.text)["emeraldwalk.runonsave"]["commands"]
    section = settings.setdefault("emeraldwalk.runonsave", {})
    others = [c for c in section.get("commands", []) if not _is_ours(c.get("cmd", ""))]
    section["commands"] = others + ours
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=4) + "\n")
    return f"wrote {path} ({hook.note})"


def _is_ours(cmd: str) -> bool:
    return "tsdev" in cmd and " reload " in cmd and "--file" in cmd


def _install_emacs(home: Path, hook: Hook) -> list[str]:
    """tsdev-reload.el next to the init file Emacs uses, and one `load` line in that init file."""
    if (home / ".emacs").exists():
        init, folder = home / ".emacs", home / ".emacs.d"
    elif (home / ".emacs.d").exists() or not (home / ".config" / "emacs").exists():
        folder = home / ".emacs.d"
        init = folder / "init.el"
    else:
        folder = home / ".config" / "emacs"
        init = folder / "init.el"
    done = [_write(folder / "tsdev-reload.el", hook.text)]
    line = f'(load {json.dumps(str(folder / "tsdev-reload.el"))} nil t)  ; {MARK}\n'
    current = init.read_text() if init.exists() else ""
    if line not in current:
        init.parent.mkdir(parents=True, exist_ok=True)
        init.write_text(current + ("" if current.endswith("\n") or not current else "\n") + line)
        done.append(f"added to {init}: {line.strip()}")
    return done
