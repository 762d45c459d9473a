"""docs/operating.md stays runnable: every `kvtier` command in its sh blocks is accepted by kvtier's
own argument parser, flag for flag (abbreviations refused, so a renamed or removed flag fails
here), and the ones that need no engine are run: `kvtier plan` on small traces written where the
page's commands put them, `kvtier fsck` on an empty directory, and every `kvtier serve` line as a
dry run (the config files the page writes with `echo` included) on a GPU machine of 64 GiB. The
series and dashboard panels the page names exist.

The commands that need an engine or a server are parsed only here; their own tests run them:
`kvtier bench multiturn` in tests/bench/test_multiturn_smoke.py (a sweep end to end) and
tests/bench/test_multiturn_mix.py (`--mix`, `--ramp`); `kvtier bench chaos` in
tests/bench/test_chaos_smoke.py and tests/bench/test_chaos_soak.py; `kvtier trace record` in
tests/integrations/test_trace_record.py; a real `kvtier serve` server, scraped by Prometheus for
every dashboard query, in tests/integrations/test_shutdown.py, and the seeds' pilot line in
tests/integrations/test_serve_seeds.py; the SLO guard and `kvtier ctl` on a real engine in
tests/integrations/test_vllm_guard.py and tests/ops/test_control.py; `kvtier tier-bench` in
tests/tiers/obj/test_obj.py and tests/tiers/p2p/test_p2p.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from kvtier.cli import build_parser, main
from kvtier.integrations.vllm.serving import serve
from tests.host.helpers import machine_of
from tests.ops.test_grafana import DASHBOARD, exported_series
from tests.trace.traces import write_trace

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "operating.md"
GIB = 1 << 30
GPU_BLOCK = 16
"""vLLM's block size on CUDA: the block size of the traces written for the page's plans."""
COVERED = {"serve", "plan", "trace", "bench", "ctl", "fsck"}
"""The subcommands the procedure needs; each must appear on the page."""


def page_commands(text: str) -> list[str]:
    """The commands of the sh blocks: one a line, a trailing `\\` joining the next line, a quoted
    string running on over lines kept whole."""
    commands: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S):
        pending = ""
        for line in block.splitlines():
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # a quote still open
                pending += "\n"
                continue
            if pending.strip():
                commands.append(pending.strip())
            pending = ""
        assert pending == "", f"unfinished command: {pending!r}"
    return commands


def placeholders(model: str, kv_dir: Path) -> dict[str, str]:
    """The page's placeholders (named at its top) and what the test puts in their place."""
    return {"MODEL": model, "KV_DIR": str(kv_dir)}


def kvtier_argvs(text: str, values: dict[str, str]) -> list[list[str]]:
    """argv (after `kvtier`) of each kvtier command, placeholders replaced."""
    argvs = []
    for command in page_commands(text):
        for name, value in values.items():
            command = command.replace(name, value)
        argv = shlex.split(command, comments=True)
        if argv[0] == "kvtier":
            argvs.append(argv[1:])
    return argvs


def strict_parser() -> argparse.ArgumentParser:
    """The parser `kvtier.cli.main` uses, with abbreviated flags refused at every level."""
    parser = build_parser()
    stack = [parser]
    while stack:
        p = stack.pop()
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    return parser


def refusal(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """Why `kvtier ARGV` would not get past its argument parsing (as `main` cuts at `--`), or
    None. Nothing is run."""
    if any(token in ("|", ">", ">>", "&&", ";", "&") for token in argv):
        return "a shell operator in a kvtier command"
    cut = argv.index("--") if "--" in argv else len(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv[:cut])
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    if argv[cut + 1:] and not getattr(args, "accepts_passthrough", False):
        return f"kvtier {args.command} takes no arguments after --"
    return None


def test_every_kvtier_command_on_the_page_parses(tmp_path: Path) -> None:
    argvs = kvtier_argvs(PAGE.read_text(), placeholders("m", tmp_path / "kv"))
    parser = strict_parser()
    refused = [(" ".join(argv), why) for argv in argvs if (why := refusal(parser, argv))]
    assert refused == []
    assert {argv[0] for argv in argvs} >= COVERED
    assert len(argvs) >= 20


def test_the_check_refuses_renamed_flags_abbreviations_and_stray_arguments() -> None:
    parser = strict_parser()
    good = ["bench", "multiturn", "--ramp", "1,2", "--ramp-step-s", "60"]
    assert refusal(parser, good) is None
    assert "unrecognized arguments: --ramp-step" in str(refusal(parser, [*good[:4], "--ramp-step", "60"]))
    assert "unrecognized" in str(refusal(parser, ["serve", "m", "--cpu-gigabytes", "4"]))
    assert "invalid choice" in str(refusal(parser, ["ctl", "switch", "fs"]))
    assert refusal(parser, ["fsck", "d", "--", "x"]) == "kvtier fsck takes no arguments after --"
    assert refusal(parser, ["serve", "m", "--", "--enforce-eager"]) is None
    assert page_commands("```sh\nkvtier plan a \\\n    --json\necho '{\n}' > f  # c\n```\n") == [
        "kvtier plan a     --json", "echo '{\n}' > f  # c"]


def _write_trace(path: Path, recorded: dict[Path, int]) -> None:
    """A small trace at `path`: of vLLM's KV events where the page records one there (chunk bytes
    from its `--bytes-per-token`), else kvtier's connector trace."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path in recorded:
        write_trace(path, [{"t": float(t), "keys": [t % 5, 10 + t % 3]} for t in range(30)],
                    block_size=GPU_BLOCK, chunk_bytes=recorded[path] * GPU_BLOCK, source="kv_events")
    else:
        write_trace(path, [{"t": float(t), "keys": [1, 2, 3 + t % 4], "prompt": 48,
                            "src": {"recomputed": 16}, "ttft": 0.01} for t in range(20)],
                    block_size=GPU_BLOCK, chunk_bytes=32768 * GPU_BLOCK)


def test_the_commands_that_need_no_engine_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In page order, in a scratch directory: `echo ... > FILE` writes FILE (JSON), `trace record`
    is replaced by the trace it would write, then plan, fsck and serve (a dry run) exit 0."""
    work, kv_dir = tmp_path / "work", tmp_path / "kv"
    work.mkdir()
    kv_dir.mkdir()
    monkeypatch.chdir(work)
    machine_of(monkeypatch, tmp_path, 64 * GIB)
    monkeypatch.setattr(serve, "is_cpu_backend", lambda env: False)
    # /dev/shm is this machine's, not the GPU machine's: the region check is left out.
    monkeypatch.setattr(serve, "check_region_size", lambda size, shm_dir, key: size)
    values = placeholders("MODEL-dir", kv_dir)
    recorded: dict[Path, int] = {}
    ran: list[str] = []
    for command in page_commands(PAGE.read_text()):
        for name, value in values.items():
            command = command.replace(name, value)
        argv = shlex.split(command, comments=True)
        if argv[0] == "echo" and ">" in argv:
            json.loads(argv[1])
            Path(argv[argv.index(">") + 1]).write_text(argv[1])
            continue
        if argv[0] != "kvtier":
            continue
        args = argv[1:]
        if args[:2] == ["trace", "record"]:
            recorded[Path(args[args.index("--out") + 1])] = int(args[args.index("--bytes-per-token") + 1])
            continue
        if args[0] == "plan":
            for trace in strict_parser().parse_args(args).traces:
                _write_trace(Path(trace), recorded)
        elif args[0] == "serve":
            cut = args.index("--") if "--" in args else len(args)
            args = [*args[:cut], "--dry-run", *args[cut:]]
        elif args[0] != "fsck":
            continue
        code = main(args)
        out, err = capsys.readouterr()
        assert code == 0, (command, out, err)
        if args[0] == "serve":
            assert "kvtier: memory plan: MemTotal 64.00 GiB" in out
        ran.append(args[0])
    assert sorted(set(ran)) == ["fsck", "plan", "serve"] and len(ran) >= 6, ran


def _vllm_metric_names() -> set[str] | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    loggers = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    return set(re.findall(r'"(vllm:[a-z_]+)"', loggers.read_text())) if loggers.is_file() else None


def test_the_series_and_panels_the_page_names_exist() -> None:
    text = PAGE.read_text()
    named = set(re.findall(r"\bkvtier_[a-z0-9_]+\b", text))
    series = exported_series()
    assert named and named <= series, sorted(named - series)
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    panels = {" ".join(t.split()) for t in re.findall(r"\*([^*`]+)\*", text)}
    assert panels and panels <= titles, sorted(panels - titles)
    vllm_names = _vllm_metric_names()
    if vllm_names is not None:
        used = set(re.findall(r"\bvllm:[a-z_]+", text))
        assert used and used <= vllm_names, sorted(used - vllm_names)
