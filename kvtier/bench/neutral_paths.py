"""Paths as a results file records them: naming no machine, so that a committed file can be shared.

A benchmark writes the model it ran, the command line that started it and the directories it
worked in. Written as they are, these carry the machine's home directory (`/root/...`,
`/home/NAME/...`), its working tree and the temp directories of the run, which mean nothing to a
reader and differ between machines. `neutral_path` rewrites them in any text, a whole command line
included, wherever an absolute path starts (at the start, or after a space, a quote, `=`, `,`, `:`
or a bracket):

- a path under the current directory becomes relative to it (`bench-results/run`);
- a path under the temp directory (`tempfile.gettempdir()`, and `/tmp`) becomes relative to it
  (`kvtier-chaos-x1y2/fs-mnt/fs`): a name, where the next run picks another;
- a path under the home directory starts with `~` (`~/.cache/kvtier/models/SmolLM2-135M-Instruct`),
  which a shell expands again.

The most specific of these roots wins (a working tree under the home directory is written
relative, not with `~`); a root of `/` is never one. Other paths (`/dev/shm`, `/mnt/kv`,
`/var/tmp`) are kept: they name no one's machine.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

HOME = "~"
RELATIVE = ""

# Where an absolute path may start inside a text: not after a character that continues a word or
# a path (so `/var/tmp/x` is not taken for `/tmp/x`).
_START = r"(?<![\w.~/-])"


def _roots() -> list[tuple[str, str]]:
    """(root, what it becomes), the longest root first; duplicates and `/` left out."""
    roots = {str(Path.cwd()): RELATIVE, tempfile.gettempdir(): RELATIVE, "/tmp": RELATIVE}
    home = os.path.expanduser("~")
    if home not in roots:
        roots[home] = HOME
    kept = {r.rstrip("/"): what for r, what in roots.items() if r.rstrip("/")}
    return sorted(kept.items(), key=lambda item: len(item[0]), reverse=True)


def neutral_path(text: str) -> str:
    """`text` with every absolute path under the current, temp or home directory rewritten as the
    module docstring says; the rest of `text` unchanged."""
    for root, what in _roots():
        pattern = re.compile(_START + re.escape(root) + r"(/|(?![\w.-]))")

        def rewrite(match: re.Match[str], what: str = what) -> str:
            if what == HOME:
                return HOME + match.group(1)
            return RELATIVE if match.group(1) == "/" else "."

        text = pattern.sub(rewrite, text)
    return text


def neutral_argv(argv: Sequence[str]) -> list[str]:
    """A command line's arguments, each through `neutral_path`."""
    return [neutral_path(arg) for arg in argv]
