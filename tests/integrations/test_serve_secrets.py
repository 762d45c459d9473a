"""`kvtier serve` with secret tier options (an S3 secret key, a redis password in a URL, a p2p
secret, a CURVE key): none is printed, none is on vLLM's command line (readable by every local user
in /proc/PID/cmdline), and the connector gets every one back from the environment the child
inherits. A misspelt key is reported without its value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.config import KVTierConfig, redact, split_secrets
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.serving import serve
from kvtier.tiers.common.options import HIDDEN
from tests.integrations.conftest import require_vllm

SECRETS = ("S3-sEcReT-kEy", "sEsSiOn-ToKeN", "rEdIs-PaSsWoRd", "p2p-sHaReD-sEcReT-0123", "CuRvE-kEy")
TIERS: list[dict[str, Any]] = [
    {"type": "obj", "bucket": "kv", "endpoint": "http://127.0.0.1:1", "access_key_id": "AKID",
     "secret_access_key": SECRETS[0], "session_token": SECRETS[1]},
    {"type": "redis", "url": f"redis://:{SECRETS[2]}@127.0.0.1:1/0"},
    {"type": "p2p", "secret": SECRETS[3], "curve_secret_key": SECRETS[4],
     "peers": ["tcp://127.0.0.1:2"]},
]
VLLM_ARGS = ["--", "--kv-cache-memory-bytes", "1000000000", "--enforce-eager"]


def config_file(tmp_path: Path, extra: dict[str, Any]) -> Path:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(extra))
    return path


def assert_no_secret(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"secrets in the text: {leaked}"


def test_dry_run_prints_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_file(tmp_path, {"cpu_bytes_to_use": 1 << 27, "secondary_tiers": TIERS})
    assert main(["serve", "m", "--config", str(path), "--dry-run", *VLLM_ARGS]) == 0
    out, err = capsys.readouterr()
    assert_no_secret(out + err)
    printed = next(line for line in out.splitlines() if line.startswith("--kv-transfer-config '"))
    tiers = json.loads(printed.split("'", 1)[1].rstrip("'"))["kv_connector_extra_config"]["secondary_tiers"]
    assert tiers[0]["secret_access_key"] == HIDDEN and tiers[0]["access_key_id"] == "AKID"
    assert tiers[1]["url"] == "redis://:***@127.0.0.1:1/0"
    assert tiers[2]["secret"] == tiers[2]["curve_secret_key"] == HIDDEN
    assert f"{serve.SECRETS_VAR}=<hidden> " in out


def test_the_child_argv_holds_no_secret_and_its_connector_gets_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(serve.os, "execve", lambda path, argv, env: started.append((argv, env)))
    extra = {"cpu_bytes_to_use": 1 << 27, "secondary_tiers": TIERS}
    assert main(["serve", "m", "--config", str(config_file(tmp_path, extra)), *VLLM_ARGS]) is None
    [(argv, env)] = started
    assert_no_secret(" ".join(argv) + capsys.readouterr().out)
    child_extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert child_extra["secrets_env"] == serve.SECRETS_VAR
    require_vllm()
    from kvtier.integrations.vllm.connector import read_config

    monkeypatch.setenv(serve.SECRETS_VAR, env[serve.SECRETS_VAR])  # what the child inherits
    parsed = read_config(child_extra, 32, announce=False)  # as the connector reads its config
    assert [t.options for t in parsed.secondary_tiers] == [
        {k: v for k, v in t.items() if k != "type"} for t in TIERS]


def test_a_config_naming_its_own_secrets_env_keeps_working(monkeypatch: pytest.MonkeyPatch) -> None:
    p2p = {k: v for k, v in TIERS[2].items() if k in ("secret", "curve_secret_key")}
    monkeypatch.setenv("MY_SECRETS", json.dumps({"p2p": p2p}))
    given = {"cpu_bytes_to_use": 1 << 27, "secrets_env": "MY_SECRETS",
             "secondary_tiers": [TIERS[0], {"type": "p2p", "peers": TIERS[2]["peers"]}]}
    argv, env = serve.child_launch("m", {"kv_connector_extra_config": given}, [], serve.os.environ)
    assert_no_secret(" ".join(argv))
    child_extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    parsed = KVTierConfig.from_dict(child_extra, environ=env)
    assert parsed.secondary_tiers[0].options["secret_access_key"] == SECRETS[0]
    assert parsed.secondary_tiers[1].options["secret"] == SECRETS[3]


@pytest.mark.parametrize("extra", [
    {"cpu_bytes_to_use": 1, "secret_acess_key": SECRETS[0]},
    {"cpu_bytes_to_use": 1, "secondary_tiers": [{**TIERS[0], "secret_acess_key": SECRETS[0]}]},
    {"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "pasword": SECRETS[2]}]},
    {"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "p2p", "secrte": SECRETS[3]}]},
])
def test_an_unknown_key_is_named_without_its_value(
    extra: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ConfigError) as e:
        KVTierConfig.from_dict(extra)
    assert e.value.value == HIDDEN
    assert_no_secret(str(e.value))
    assert main(["serve", "m", "--config", str(config_file(tmp_path, extra)), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert_no_secret(out + err)
    assert e.value.key in err


def test_secrets_env_errors_name_the_key_and_show_no_secret() -> None:
    public, secrets = split_secrets({"cpu_bytes_to_use": 1, "secondary_tiers": TIERS})
    public["secrets_env"] = "KVTIER_TEST_SECRETS"
    with pytest.raises(ConfigError, match="not set") as e:
        KVTierConfig.from_dict(public, environ={})
    assert e.value.key == "secrets_env"
    with pytest.raises(ConfigError, match="JSON object") as e:
        KVTierConfig.from_dict(public, environ={"KVTIER_TEST_SECRETS": SECRETS[0]})
    assert_no_secret(str(e.value))
    twice = {**public, "secondary_tiers": TIERS}
    with pytest.raises(ConfigError, match="both") as e:
        KVTierConfig.from_dict(twice, environ={"KVTIER_TEST_SECRETS": json.dumps(secrets)})
    assert e.value.key == "secondary_tiers[0].secret_access_key"
    assert_no_secret(str(e.value))
    with pytest.raises(ConfigError, match="not in secondary_tiers") as e:
        KVTierConfig.from_dict(public, environ={"KVTIER_TEST_SECRETS": json.dumps({**secrets, "x": {}})})
    assert_no_secret(str(e.value))


def test_redact_and_the_config_repr_show_no_secret() -> None:
    extra = {"cpu_bytes_to_use": 1, "secondary_tiers": TIERS}
    assert_no_secret(json.dumps(redact(extra)))
    assert_no_secret(repr(KVTierConfig.from_dict(extra)))
    assert redact({"cpu_bytes_to_use": 1}) == {"cpu_bytes_to_use": 1}
