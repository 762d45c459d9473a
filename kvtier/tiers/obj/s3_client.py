"""S3 I/O for the obj tier: the shared boto3 client, the start-up probe, and one chunk's requests.

Client: one boto3 client per tier, shared by all I/O threads (boto3 clients are thread-safe), with
a connection pool of at least `io_threads` connections. Payload signing and boto3's own request and
response checksums are off: every object carries the `chunkfmt` xxh3-128 checksum (or the fleet
key's MAC, with one), verified on load, so hashing each body again (SHA-256 over plain HTTP, CRC32)
would only cost CPU under the GIL.
Credentials given as options go straight into the client and are kept nowhere else; no message
built here contains them.

Copies: boto3 takes a request body only as one bytes-like object or a file-like one (read in 16 KiB
pieces), so a put packs header and row into a per-thread, pre-touched buffer (one memcpy of the row)
and sends it in one `sendall`. A get reads the header, then the row with `readinto` straight into
the host-region slot (urllib3 reads into its own buffer first: one more memcpy, not avoidable
without reaching into urllib3's internals).
"""

from __future__ import annotations

import datetime
import email.utils
import functools
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.common.options import HIDDEN

NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})
_BAD_KEY_ID = frozenset({"InvalidAccessKeyId", "InvalidClientTokenId", "UnrecognizedClientException"})
_BAD_SECRET = frozenset({"SignatureDoesNotMatch", "InvalidSignature"})
_DENIED = frozenset({"AccessDenied", "403", "Forbidden", "ExpiredToken", "InvalidToken"})


def error_code(exc: BaseException) -> str:
    """A short, credential-free name for a failure: the S3 error code, else the exception class."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
    return type(exc).__name__


def is_connection_error(exc: BaseException) -> bool:
    """Whether the server could not be reached or stopped answering (not an S3 error reply)."""
    from botocore.exceptions import ConnectionError, HTTPClientError

    return isinstance(exc, ConnectionError | HTTPClientError)


_ZERO = datetime.timedelta(0)


def parse_timestamp(value: Any) -> datetime.datetime:
    """`value`, a timestamp from a response, as the aware datetime botocore's parser gives.

    botocore parses every timestamp with `dateutil.parser.parse`, about 100 us each under the GIL;
    a listing page holds 1,000 `LastModified`s, and parsing them was 60% of the start-up listing at
    100,000 objects (BENCHMARKS.md). S3 writes them as ISO 8601 in UTC (`2026-12-06T01:15:00.000Z`)
    and HEAD's `Last-Modified` as RFC 1123 (`Sun, 06 Dec 2026 01:15:00 GMT`): those two forms are
    read here with the standard library, every other value by botocore's own parser.
    Holds: `parse_timestamp(v) == botocore.utils.parse_timestamp(v)` for every value (the same
    instant; the forms read here come back in dateutil's `tzutc`, where botocore may give `tzlocal`
    on a machine whose zone is UTC); it raises ValueError where botocore's does."""
    from botocore.utils import parse_timestamp as botocore_parse_timestamp
    from dateutil.tz import tzutc

    if isinstance(value, str):
        parsed: datetime.datetime | None = None
        try:
            if len(value) >= 20 and value[10] == "T" and value.endswith("Z"):
                parsed = datetime.datetime.fromisoformat(value)
            elif value.endswith(" GMT") and "," in value:
                parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            parsed = None
        if parsed is not None and parsed.utcoffset() == _ZERO:
            return parsed.replace(tzinfo=tzutc())
    result: datetime.datetime = botocore_parse_timestamp(value)
    return result


def make_client(
    *,
    endpoint: str | None,
    region: str | None,
    access_key_id: str | None,
    secret_access_key: str | None,
    session_token: str | None,
    connect_timeout_s: float,
    read_timeout_s: float,
    pool_connections: int,
    path_style: bool,
    attempts: int,
) -> Any:
    """A boto3 S3 client; credentials not given come from the environment or the AWS chain.

    Over `http://` the payload is signed (its SHA-256 in the signed headers), so nobody between
    the engine and the server can swap a body unseen; over TLS, which protects it already, not.
    Timestamps are parsed by `parse_timestamp` (the same values, a fraction of the CPU:
    the start-up listing parses one per object)."""
    import boto3
    import botocore.session
    from botocore.config import Config

    config = Config(
        region_name=region,
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        retries={"total_max_attempts": attempts, "mode": "standard"},
        max_pool_connections=pool_connections,
        tcp_keepalive=True,
        s3={"addressing_style": "path" if path_style else "auto",
            "payload_signing_enabled": endpoint is not None and endpoint.lower().startswith("http://")},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    core = botocore.session.get_session()
    core.get_component("response_parser_factory").set_parser_defaults(
        timestamp_parser=parse_timestamp)
    session = boto3.session.Session(
        aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key,
        aws_session_token=session_token, region_name=region, botocore_session=core,
    )
    return session.client("s3", endpoint_url=endpoint, config=config)


def connect(o: Mapping[str, Any], layout_prefix: str) -> Any:
    """The client for the I/O threads, given the tier's checked options `o`, once a probe with a
    short-timeout client passed (`probe`: ConfigError naming the option at fault).

    The I/O client's connect timeout is `read_timeout_s` too (the longer of the two): the HTTP
    library bounds sending a request's body by the connect timeout, and a server may stall reading
    a chunk-sized body for longer than it takes to accept a connection. `connect_timeout_s`
    bounds the probe."""
    path_style = o["endpoint"] is not None if o["path_style"] is None else o["path_style"]
    new_client = functools.partial(
        make_client, endpoint=o["endpoint"], region=o["region"], access_key_id=o["access_key_id"],
        secret_access_key=o["secret_access_key"], session_token=o["session_token"],
        connect_timeout_s=o["connect_timeout_s"], path_style=path_style,
    )
    probe_client = new_client(read_timeout_s=o["connect_timeout_s"], pool_connections=1, attempts=1)
    try:
        probe(probe_client, endpoint=o["endpoint"], bucket=o["bucket"], layout_prefix=layout_prefix,
              create_bucket=o["create_bucket"])
    finally:
        probe_client.close()
    body_timeout_s = max(o["connect_timeout_s"], o["read_timeout_s"])
    return new_client(read_timeout_s=o["read_timeout_s"], pool_connections=o["io_threads"] + 1,
                      attempts=2, connect_timeout_s=body_timeout_s)


def probe(client: Any, *, endpoint: str | None, bucket: str, layout_prefix: str,
          create_bucket: bool) -> None:
    """Check at start-up that the bucket can be listed, written and deleted from.

    Raises ConfigError naming the option at fault (endpoint, bucket, credentials); the client given
    must have short timeouts and no retries, so an unreachable endpoint fails within seconds.
    """
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    where = endpoint or "the default AWS endpoint"
    try:
        try:
            client.list_objects_v2(Bucket=bucket, Prefix=layout_prefix, MaxKeys=1)
        except ClientError as e:
            if error_code(e) != "NoSuchBucket" or not create_bucket:
                raise
            region = client.meta.region_name
            where_to = {} if region in (None, "us-east-1") else {
                "CreateBucketConfiguration": {"LocationConstraint": region}}
            client.create_bucket(Bucket=bucket, **where_to)
        name = f"{layout_prefix}probe-{secrets.token_hex(8)}"
        client.put_object(Bucket=bucket, Key=name, Body=b"kvtier probe")
        client.delete_object(Bucket=bucket, Key=name)
    except NoCredentialsError:
        raise ConfigError("access_key_id", None, "no S3 credentials in the tier options, the "
                          "environment or the AWS configuration files") from None
    except ClientError as e:
        code = error_code(e)
        if code in ("NoSuchBucket", "404"):
            raise ConfigError("bucket", bucket, f"no such bucket at {where} (create it, or set "
                              "create_bucket: true)") from None
        if code in _BAD_KEY_ID:
            raise ConfigError("access_key_id", HIDDEN, f"{where} does not know this access key "
                              f"({code})") from None
        if code in _BAD_SECRET:
            raise ConfigError("secret_access_key", HIDDEN, f"{where} rejects the request "
                              f"signature: wrong secret key ({code})") from None
        if code in _DENIED:
            raise ConfigError("access_key_id", HIDDEN, f"these credentials may not list, write "
                              f"and delete objects in bucket {bucket!r} at {where} ({code})") from None
        raise ConfigError("endpoint", endpoint, f"the S3 probe of bucket {bucket!r} failed: "
                          f"{code}") from None
    except BotoCoreError as e:
        raise ConfigError("endpoint", endpoint, f"cannot reach S3 at {where}: "
                          f"{type(e).__name__}") from None


class ChunkIO:
    """One chunk object's requests. Methods are called from I/O threads; raise botocore errors."""

    def __init__(self, client: Any, bucket: str, layout_fp: bytes, row_bytes: int,
                 fleet: FleetKey | None = None) -> None:
        self.client = client
        self.bucket = bucket
        self.layout_fp = layout_fp
        self.fleet = fleet
        """The fleet key objects are MACed with and verified under; None: checksums."""
        self.object_bytes = chunkfmt.HEADER_BYTES + row_bytes
        self._local = threading.local()

    def _put_buffer(self) -> bytearray:
        buf: bytearray | None = getattr(self._local, "put", None)
        if buf is None:
            buf = bytearray(self.object_bytes)  # zero-filled: touched once, reused per request
            self._local.put = buf
        return buf

    def _header_buffer(self) -> memoryview:
        buf: memoryview | None = getattr(self._local, "header", None)
        if buf is None:
            buf = memoryview(bytearray(chunkfmt.HEADER_BYTES))
            self._local.header = buf
        return buf

    def put(self, name: str, key: bytes, row: memoryview) -> None:
        buf = self._put_buffer()
        view = memoryview(buf)
        view[chunkfmt.HEADER_BYTES :] = row
        chunkfmt.pack_header(view, key, self.layout_fp, view[chunkfmt.HEADER_BYTES :], self.fleet)
        self.client.put_object(Bucket=self.bucket, Key=name, Body=buf)

    def exists(self, name: str) -> bool:
        """HEAD the object: True if present, False if absent; other failures raise."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=name)
        except ClientError as e:
            if error_code(e) in NOT_FOUND:
                return False
            raise
        return True

    def get(self, name: str, key: bytes, row: memoryview) -> ChunkError | None:
        """Fill `row` from the object; None when it is a valid chunk of `key`, else why not (the
        row then holds garbage). A missing object raises ClientError with a NOT_FOUND code."""
        response = self.client.get_object(Bucket=self.bucket, Key=name)
        body = response["Body"]
        complete = False
        try:
            header = self._header_buffer()
            got = _fill(body, header)
            err, digest = chunkfmt.check_header(header[:got], key, self.layout_fp, len(row), self.fleet)
            if err is not None:
                return err
            if response.get("ContentLength") != self.object_bytes:
                return ChunkError.LENGTH
            if _fill(body, row) < len(row) or body.read(1):
                return ChunkError.SHORT
            complete = True
            return chunkfmt.check_payload(header, row, digest, self.fleet)
        finally:
            if not complete:
                body.close()  # unread bytes: drop the connection rather than drain it

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=name)

    def list_names(self, prefix: str) -> list[tuple[str, int, float]]:
        """(name, size, last-modified timestamp) of every object under `prefix`."""
        out: list[tuple[str, int, float]] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                      Prefix=prefix)
        for page in pages:
            for item in page.get("Contents", ()):
                out.append((item["Key"], int(item["Size"]), item["LastModified"].timestamp()))
        return out


def _fill(body: Any, view: memoryview) -> int:
    """Read from a response body into `view` until it is full or the body ends; bytes read."""
    got = 0
    while got < len(view):
        n = body.readinto(view[got:])
        if not n:
            break
        got += n
    return got
