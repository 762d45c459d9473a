"""The redis tier's `password_file` against a real server that requires a password: the password
is read from the file at start, never shown, and a file that cannot be used is a config error that
names the option."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.base import Job, JobKind, LookupResult
from kvtier.tiers.redis.tier import RedisTier
from tests.conftest import fill_slot, random_key, settle_lookup, wait_jobs
from tests.services.redis_server import fresh_prefix

PASSWORD = "fi1e-Pa55word"


def test_the_password_comes_from_its_file(tmp_path: Path, ctx, redis_server_factory, caplog) -> None:
    server = redis_server_factory("--requirepass", PASSWORD)
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "redis-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    tier = RedisTier(ctx, url=server.url, password_file=str(path), key_prefix=fresh_prefix())
    try:
        key = random_key()
        fill_slot(ctx, 0)
        tier.submit_store(Job(1, JobKind.STORE, (key,), (0,)))
        assert wait_jobs(tier, 1)[0].success
        assert settle_lookup(tier, [key]) == [LookupResult.HIT]
        assert PASSWORD not in repr(tier) and PASSWORD not in str(tier.counts())
    finally:
        tier.shutdown()
    assert PASSWORD not in caplog.text


def test_an_unusable_password_file_names_the_option(tmp_path: Path, ctx, redis_server_factory) -> None:
    server = redis_server_factory("--requirepass", PASSWORD)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-Pa55word\n")
    for path, why in ((tmp_path / "missing", "cannot be read"), (empty, "holds no password")):
        with pytest.raises(ConfigError, match=why) as e:
            RedisTier(ctx, url=server.url, password_file=str(path))
        assert e.value.key == "password_file"
    with pytest.raises(ConfigError) as e:
        RedisTier(ctx, url=f"redis://:{PASSWORD}@127.0.0.1:{server.port}", password_file=str(wrong))
    assert e.value.key == "password_file" and PASSWORD not in str(e.value)
    with pytest.raises(ConfigError) as e:
        RedisTier(ctx, url=server.url, password_file=str(wrong))
    assert e.value.key == "url" and "not-the" not in str(e.value)
