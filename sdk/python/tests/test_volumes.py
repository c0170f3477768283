"""Volumes through the Python SDK, against a real server (crun, ext4 on loop devices)."""

import uuid

import pytest

import dsec


@pytest.fixture()
def volume(client):
    v = client.create_volume("py-" + uuid.uuid4().hex[:8], size_mb=32)
    yield v
    for sb in client.list(labels={"volume-test": v.name}):
        sb.close()
    try:
        v.delete()
    except dsec.NotFound:
        pass


def test_a_volume_is_written_without_a_sandbox_and_read_in_one(client, volume):
    info = volume.write_file("/hello.txt", "hi from python", uid=1000, mode=0o640)
    assert (info.path, info.uid, info.mode, info.size) == ("/hello.txt", 1000, 0o640, 14)
    assert volume.read_file("/hello.txt") == b"hi from python"
    with pytest.raises(dsec.Conflict):
        volume.write_file("/hello.txt", "again")
    volume.write_file("/hello.txt", "again\n", overwrite=True, uid=1000)
    volume.make_dir("/a/b", parents=True)
    assert [e.path for e in volume.list_dir("/", depth=3)] == ["/a", "/a/b", "/hello.txt"]
    with client.create("busybox", ttl_s=300, labels={"volume-test": volume.name}, volumes=[volume.name + ":/data"]) as sb:
        r = sb.exec("cat /data/hello.txt; stat -c %u /data/hello.txt; echo written > /data/a/b/out")
        assert r.stdout == "again\n1000\n"
    assert volume.read_file("/a/b/out") == b"written\n"


def test_one_read_write_mount_many_read_only_and_no_delete_in_use(client, volume):
    owner = client.create("busybox", ttl_s=300, labels={"volume-test": volume.name}, volumes=[(volume.name, "/data")])
    with pytest.raises(dsec.Conflict) as e:
        client.create("busybox", ttl_s=300, labels={"volume-test": volume.name}, volumes=[volume.name + ":/data"])
    assert owner.id in str(e.value)
    readers = client.create("busybox", count=2, ttl_s=300, labels={"volume-test": volume.name}, volumes=[volume.name + ":/data:ro"])
    assert len(readers) == 2
    assert "Read-only file system" in readers[0].exec("touch /data/x").stderr
    got = client.volume(volume.name)
    assert got.writer == owner.id and sorted(got.readers) == sorted(r.id for r in readers)
    with pytest.raises(dsec.Conflict):
        client.delete_volume(volume.name)
    owner.close()
    for r in readers:
        r.close()
    client.delete_volume(volume)
    assert volume.name not in [v.name for v in client.volumes()]


def test_mount_strings_are_checked_before_sending():
    with pytest.raises(ValueError):
        dsec.client._build_spec("busybox", volumes=["no-path"])
