"""The shared-memory host region: unique names, attach, removal, and cleanup after a crashed owner."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.host.region import HostRegion, remove_stale_regions


def test_two_regions_never_share_a_name() -> None:
    with HostRegion.create(8192) as a, HostRegion.create(8192) as b:
        assert a.name != b.name
        assert os.path.exists(a.path) and os.path.exists(b.path)


def test_attached_process_sees_the_owners_bytes() -> None:
    with HostRegion.create(3 * 4096) as region:
        region.buf[4096:4100] = b"kvtr"
        out = subprocess.run(
            [sys.executable, "-c",
             "import sys; from kvtier.host.region import HostRegion;"
             "r = HostRegion.attach(sys.argv[1]); print(bytes(r.buf[4096:4100]).decode());"
             "r.buf[0:2] = b'ok'; r.close()", region.name],
            capture_output=True, text=True, check=True,
        )
        assert out.stdout.strip() == "kvtr"
        assert bytes(region.buf[0:2]) == b"ok"
        assert os.path.exists(region.path), "a non-owner's close must not remove the segment"


def test_size_is_rounded_to_pages_and_close_removes_it() -> None:
    region = HostRegion.create(5000)
    assert region.size == 8192 and len(region.buf) == 8192
    path = region.path
    region.close()
    region.close()
    assert not os.path.exists(path)


def test_segment_of_a_crashed_owner_is_removed_on_next_start() -> None:
    code = ("import os; from kvtier.host.region import HostRegion;"
            "r = HostRegion.create(4096); print(r.name, flush=True); os._exit(0)")
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert os.path.exists(f"/dev/shm/{name}")
    with HostRegion.create(4096) as mine:
        assert not os.path.exists(f"/dev/shm/{name}")
        assert os.path.exists(mine.path)
        assert name not in remove_stale_regions()
        assert os.path.exists(mine.path), "a live owner's segment is never removed"


def test_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        HostRegion.create(0)
    with pytest.raises(ConfigError, match="fit in /dev/shm"):
        HostRegion.create(1 << 50)


def test_attach_rejects_foreign_names() -> None:
    with pytest.raises(ValueError, match="not a kvtier host region"):
        HostRegion.attach("../etc/passwd")


def _resident_kib(address: int) -> int:
    """The resident size of this process's mapping that starts at `address` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if "-" in line.split(" ")[0] and int(line.split("-")[0], 16) == address:
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


def test_an_attached_region_is_mapped_whole_before_its_first_copy() -> None:
    """A copy into a page the attaching process has not mapped yet takes a fault per page: an
    engine's stores ran at 2.2 GB/s that way against 5-5.7 into a mapped region."""
    with HostRegion.create(64 * 4096) as region:
        attached = HostRegion.attach(region.name)
        try:
            assert _resident_kib(attached.address) == 64 * 4
        finally:
            attached.close()


def test_rows_outlive_a_closed_region_without_a_fault() -> None:
    """A tensor over the rows keeps the mapping: closing the region under it (the owner's file
    removed, the pin gone) never unmaps memory the tensor still reads."""
    script = (
        "from kvtier.format.layout import host_rows; from kvtier.host.region import HostRegion\n"
        "r = HostRegion.create(1 << 20); rows = host_rows(r.buf, 4096, 256)[3:]; rows.fill_(7)\n"
        "r.close(); import os; assert not os.path.exists(r.path)\n"
        "print(int(rows.sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(7 * 253 * 4096)]


def test_a_live_region_whose_name_looks_dead_is_kept_until_its_owner_dies() -> None:
    """Containers sharing /dev/shm see segments named with another PID namespace's pids: a name
    whose pid is no live process here says nothing. The owner's lock keeps its segment; once the
    owner is gone (killed, no close), the segment is stale and removed."""
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from kvtier.host.region import HostRegion\n"
         "r = HostRegion.create(8192, pretouch=False); print(r.path, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert owner.stdout is not None
        path = owner.stdout.readline().strip()
        pid = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 1000
        foreign = os.path.join(os.path.dirname(path), f"kvtier-{pid}-12345-{'ab' * 4}")
        os.rename(path, foreign)  # the same segment, as another namespace's engine names it
        assert os.path.basename(foreign) not in remove_stale_regions()
        assert os.path.exists(foreign)
    finally:
        owner.kill()
        owner.wait()
    assert os.path.basename(foreign) in remove_stale_regions()
    assert not os.path.exists(foreign)
