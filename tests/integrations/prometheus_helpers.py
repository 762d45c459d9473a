"""A real Prometheus (Debian's `prometheus`, installed by set-up) scraping one target on loopback,
queried through its HTTP API, and the Grafana dashboard's PromQL made evaluable there."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

from tests.integrations.serve_helpers import free_port, http_get, stop_process

PROMETHEUS = shutil.which("prometheus")
"""The binary, or None where it is not installed (`make setup` installs it)."""
WINDOW = "1m"
"""What Grafana's range variables stand for here: every sample of a short test run."""
BUILTINS = {"__rate_interval": WINDOW, "__interval": WINDOW, "__range": WINDOW,
            "__interval_ms": "60000", "__range_ms": "60000", "__range_s": "60"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


class Prometheus:
    """Prometheus scraping `target` (host:port, path /metrics) every second, its data under `tmp`.
    Its first scrape comes up to 5 s after it starts (its target discovery sends updates every
    5 s): start it with the target's server, not when the data is wanted."""

    def __init__(self, tmp: Path, target: str) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "kvtier", "static_configs": [{"targets": [target]}]}],
        }))
        self.log_path = tmp / "prometheus.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)

    def close(self) -> None:
        """Stop Prometheus (idempotent)."""
        stop_process(self.proc)

    def _api(self, path: str, **params: str) -> Any:
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        reply = json.loads(http_get(url, timeout=10))
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> list[Any]:
        """The result of instant query `expr` now (a vector's series; a scalar's one pair)."""
        data = self._api("query", query=expr)
        return [data["result"]] if data["resultType"] == "scalar" else list(data["result"])

    def wait_scraped(self, since: float, deadline: float) -> None:
        """Until the target has been scraped, up, by a scrape that began after Unix time `since`;
        fails with the end of Prometheus' log after `deadline` (monotonic). A series that appeared
        a second before `since` has two samples then: enough for `rate`."""
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                last = self.query('timestamp(up{job="kvtier"} == 1)')
            except OSError:
                last = []
            if last and float(last[0]["value"][1]) > since:
                return
            assert time.monotonic() < deadline, self.log_path.read_text()[-3000:]
            time.sleep(0.2)

    def evaluable(self, expr: str) -> str:
        """`expr` with Grafana's variables replaced: range ones by `WINDOW`, a label's by the first
        value Prometheus has for the label of that name (as Grafana preselects the first)."""

        def value(match: re.Match[str]) -> str:
            name = next(g for g in match.groups() if g)
            if name in BUILTINS:
                return BUILTINS[name]
            values = self._api(f"label/{name}/values")
            assert values, f"{expr}: no value of label {name} for ${name}"
            return str(values[0])

        return VARIABLE.sub(value, expr)


def dashboard_exprs(dashboard: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel of a Grafana dashboard file."""
    panels = json.loads(dashboard.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]
