"""`kvtier ctl`: talk to a running engine's control socket (`kvtier.ops.control_server`).

    kvtier ctl list                 tiers with state, fill and health (up, restarts, last failure)
    kvtier ctl disable|enable TIER  stop or resume a secondary tier's loads and stores
    kvtier ctl guard                the SLO guard's state

The engine is found by `--socket`, else as the one live `engine-*.sock` in `--dir` (default: the
engines' default control directory); with several engines running, `--socket` picks one.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierError
from kvtier.ops.control_server import control_dirs, request, unix_address


class ControlError(KVTierError):
    """No engine to talk to, or the engine refused the request."""


def find_socket(directories: list[Path]) -> Path:
    """The one control socket in `directories` that an engine answers on."""
    live = []
    for path in sorted(p for d in directories for p in d.glob("engine-*.sock")):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                with unix_address(path) as address:
                    probe.connect(address)
            except OSError:
                continue  # left by an engine that did not shut down
        live.append(path)
    if not live:
        where = ", ".join(str(d) for d in directories)
        raise ControlError(f"no running kvtier engine has a control socket in {where}")
    if len(live) > 1:
        names = ", ".join(str(p) for p in live)
        raise ControlError(f"several kvtier engines are running; pick one with --socket: {names}")
    return live[0]


def run(args: argparse.Namespace) -> int:
    path = Path(args.socket) if args.socket else find_socket([Path(args.dir)] if args.dir else control_dirs())
    message: dict[str, Any] = {"cmd": args.action}
    if args.action in ("disable", "enable"):
        message["tier"] = args.tier
    reply = request(path, message)
    if "error" in reply:
        raise ControlError(reply["error"])
    if args.json or args.action == "guard":
        print(json.dumps(reply, indent=2))
    elif args.action == "list":
        print(f"{'tier':<16}{'state':<10}{'chunks':>10}{'used':>14}{'capacity':>14}{'fill':>8}"
              f"  {'health':<8}{'restarts':>9}  last failure")
        for t in reply["tiers"]:
            state = "enabled" if t["enabled"] else "disabled"
            cap = f"{t['capacity_bytes']:.0f}" if t["capacity_bytes"] else "unbounded"
            failure = t.get("last_failure")
            last = "-" if not failure else (
                f"{failure['cause']} at {time.strftime('%H:%M:%S', time.localtime(failure['at']))}")
            print(f"{t['tier']:<16}{state:<10}{t['used_chunks']:>10.0f}{t['used_bytes']:>14.0f}"
                  f"{cap:>14}{t['used_fraction']:>8.1%}  {'up' if t.get('up', True) else 'down':<8}"
                  f"{t.get('restarts', 0):>9}  {last}")
    else:
        done = "" if reply["applied"] else " (applies at the engine's next step)"
        print(f"tier {reply['tier']}: {'enabled' if reply['enabled'] else 'disabled'}{done}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ctl", help="list, switch and inspect the tiers of a running engine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", help="the engine's control socket")
    p.add_argument("--dir", help="where to look for one (default: the engines' default)")
    p.add_argument("--json", action="store_true", help="print the raw JSON reply")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="tiers with state and fill")
    actions.add_parser("guard", help="the SLO guard's state")
    for name in ("disable", "enable"):
        actions.add_parser(name, help=f"{name} a secondary tier").add_argument("tier")
    p.set_defaults(func=run)
