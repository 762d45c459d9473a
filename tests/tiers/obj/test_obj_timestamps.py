"""The obj tier's timestamp parser gives botocore's values, and the tier's client uses it: a listing
parses one `LastModified` per object, which botocore's own parser (dateutil) made most of the
start-up listing's cost."""

from __future__ import annotations

from typing import Any

import botocore.utils
import dateutil.parser
import pytest

from kvtier.tiers.obj.s3_client import make_client, parse_timestamp

VALUES = (
    "2026-12-06T01:15:00.000Z", "2026-12-06T01:15:00Z", "2026-12-06T01:15:00.123456Z",
    "2026-12-06T01:15:00.1234Z", "Sun, 06 Dec 2026 01:15:00 GMT", "Mon, 07 Dec 2026 23:59:59 GMT",
    "2026-12-06T01:15:00+02:00", "2026-12-06 01:15:00", "1700000000", 1700000000, 1700000000.5,
)


@pytest.mark.parametrize("value", VALUES)
def test_every_value_parses_to_botocores_instant(value: Any) -> None:
    ours, theirs = parse_timestamp(value), botocore.utils.parse_timestamp(value)
    assert ours == theirs
    assert ours.utcoffset() == theirs.utcoffset()


@pytest.mark.parametrize("value", ["not a time", "2026-13-45T99:00:00Z", "Sun, 99 Foo 2026 GMT"])
def test_a_bad_value_raises_as_botocore_does(value: str) -> None:
    with pytest.raises(ValueError):
        botocore.utils.parse_timestamp(value)
    with pytest.raises(ValueError):
        parse_timestamp(value)


def test_the_tiers_client_lists_and_heads_without_dateutil(s3_server, s3_tier_options,
                                                          monkeypatch) -> None:
    """With dateutil's parser broken, botocore's default would fail on the first timestamp."""
    o = s3_tier_options
    client = make_client(endpoint=o["endpoint"], region=o["region"],
                         access_key_id=o["access_key_id"], secret_access_key=o["secret_access_key"],
                         session_token=None, connect_timeout_s=2.0, read_timeout_s=10.0,
                         pool_connections=1, path_style=True, attempts=1)
    try:
        client.put_object(Bucket=o["bucket"], Key="kvtier/t/a", Body=b"x")

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("dateutil parser called")

        monkeypatch.setattr(dateutil.parser, "parse", broken)
        listed = client.list_objects_v2(Bucket=o["bucket"], Prefix="kvtier/")["Contents"]
        head = client.head_object(Bucket=o["bucket"], Key="kvtier/t/a")
        monkeypatch.undo()
        assert [item["Key"] for item in listed] == ["kvtier/t/a"]
        assert abs((head["LastModified"] - listed[0]["LastModified"]).total_seconds()) < 2
        assert s3_server.client().list_objects_v2(Bucket=o["bucket"])["Contents"][0][
            "LastModified"] == listed[0]["LastModified"]
        client.delete_object(Bucket=o["bucket"], Key="kvtier/t/a")
    finally:
        client.close()
