"""Volumes: named file systems of a project that outlive sandboxes.

    vol = client.create_volume("data", size_mb=2048)
    vol.write_file("/train.jsonl", b"...")               # no sandbox needed
    with client.create("debian", volumes=["data:/data"]) as sb:        # read-write, this sandbox alone
        sb.exec("wc -l /data/train.jsonl")
    readers = client.create("debian", count=8, volumes=["data:/data:ro"])  # shared read-only

A volume lives on one node, has a size that is its limit (ENOSPC beyond it),
and belongs to the API key's project. Read-only mounts are shared; a
read-write mount is one sandbox's at a time (a second is a Conflict while
the first sandbox lives); deleting a mounted volume is a Conflict. Only
kind ``container`` mounts volumes.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, IO, Iterator, List, Mapping, Optional, Sequence, Union

from ._wire import unb64

if TYPE_CHECKING:
    from .client import Client

_VOLUMES = "dsec.v1.VolumeService"

MountLike = Union[str, Mapping[str, Any], Sequence[Any]]


def mount_wire(m: MountLike) -> Dict[str, Any]:
    """A volume mount as the API takes it, from ``"name:/path"``,
    ``"name:/path:ro"``, a ``(name, path[, read_only])`` tuple or a dict with
    ``name``, ``path`` and ``read_only``."""
    if isinstance(m, str):
        parts = m.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/") or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise ValueError(f"volume mount {m!r}: use 'name:/path' or 'name:/path:ro'")
        name, path, ro = parts[0], parts[1], len(parts) == 3 and parts[2] == "ro"
    elif isinstance(m, Mapping):
        name, path, ro = m["name"], m["path"], bool(m.get("read_only", m.get("readOnly", False)))
    else:
        name, path = m[0], m[1]
        ro = bool(m[2]) if len(m) > 2 else False
    out: Dict[str, Any] = {"name": str(name), "path": str(path)}
    if ro:
        out["readOnly"] = True
    return out


def _int(v: Any) -> int:
    return int(v) if v not in (None, "") else 0


@dataclass
class VolumeFileInfo:
    path: str
    name: str = ""
    type: str = ""
    size: int = 0
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime: str = ""
    symlink_target: str = ""

    @classmethod
    def _from(cls, m: Dict[str, Any]) -> "VolumeFileInfo":
        return cls(path=m.get("path", ""), name=m.get("name", ""), type=m.get("type", ""), size=_int(m.get("size")),
                   mode=_int(m.get("mode")), uid=_int(m.get("uid")), gid=_int(m.get("gid")), mtime=m.get("mtime", ""),
                   symlink_target=m.get("symlinkTarget", ""))


@dataclass
class Volume:
    """A volume. Its content is read and written without a sandbox."""

    id: str
    name: str
    node: str = ""
    size_mb: int = 0
    used_bytes: int = 0
    created_at: str = ""
    labels: Dict[str, str] = field(default_factory=dict)
    writer: str = ""
    readers: List[str] = field(default_factory=list)
    _client: Optional["Client"] = field(default=None, repr=False, compare=False)

    @classmethod
    def _from(cls, client: "Client", m: Dict[str, Any]) -> "Volume":
        return cls(id=m.get("id", ""), name=m.get("name", ""), node=m.get("node", ""), size_mb=_int(m.get("sizeMb")),
                   used_bytes=_int(m.get("usedBytes")), created_at=m.get("createdAt", ""), labels=dict(m.get("labels") or {}),
                   writer=m.get("writer", ""), readers=list(m.get("readers") or []), _client=client)

    def _call(self, method: str, req: Dict[str, Any]) -> Dict[str, Any]:
        assert self._client is not None
        return self._client._t.unary(_VOLUMES, method, dict(req, volume=self.id))

    def refresh(self) -> "Volume":
        assert self._client is not None
        return self._client.volume(self.id)

    def delete(self) -> None:
        """Delete the volume and its content (a Conflict while a sandbox mounts it)."""
        assert self._client is not None
        self._client.delete_volume(self.id)

    def write_file(self, path: str, data: Union[bytes, str, IO[bytes]], *, overwrite: bool = False,
                   mode: Optional[int] = None, uid: Optional[int] = None, gid: Optional[int] = None,
                   chunk_size: int = 1 << 20) -> VolumeFileInfo:
        """Write a file (its parent directory must exist). An existing file
        is a Conflict unless ``overwrite``. ``uid``/``gid`` are ids as
        sandboxes see them (0 is their root; default 0); ``mode`` defaults
        to 0o644."""
        hdr: Dict[str, Any] = {"volume": self.id, "path": path, "overwrite": overwrite}
        for k, v in (("mode", mode), ("uid", uid), ("gid", gid)):
            if v is not None:
                hdr[k] = int(v)
        assert self._client is not None
        return VolumeFileInfo._from(self._client._t.client_stream(_VOLUMES, "WriteVolumeFile", [{"header": hdr}],
                                                   _chunks(data, chunk_size)))

    def read_file(self, path: str) -> bytes:
        """Read a whole file."""
        return b"".join(self.read_file_stream(path))

    def read_file_stream(self, path: str) -> Iterator[bytes]:
        assert self._client is not None
        for m in self._client._t.stream(_VOLUMES, "ReadVolumeFile", {"volume": self.id, "path": path}):
            if "data" in m:
                yield unb64(m["data"])

    def stat(self, path: str) -> VolumeFileInfo:
        return VolumeFileInfo._from(self._call("StatVolumePath", {"path": path}))

    def exists(self, path: str) -> bool:
        from .errors import NotFound

        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def list_dir(self, path: str = "/", depth: int = 1) -> List[VolumeFileInfo]:
        m = self._call("ListVolumeDir", {"path": path, "depth": depth})
        return [VolumeFileInfo._from(e) for e in m.get("entries", [])]

    def make_dir(self, path: str, *, parents: bool = False, mode: Optional[int] = None,
                 uid: Optional[int] = None, gid: Optional[int] = None) -> VolumeFileInfo:
        req: Dict[str, Any] = {"path": path, "parents": parents}
        for k, v in (("mode", mode), ("uid", uid), ("gid", gid)):
            if v is not None:
                req[k] = int(v)
        return VolumeFileInfo._from(self._call("MakeVolumeDir", req))

    def remove(self, path: str) -> None:
        """Remove a file, or a directory with everything in it."""
        self._call("RemoveVolumePath", {"path": path})

    def set_attrs(self, path: str, *, mode: Optional[int] = None, uid: Optional[int] = None,
                  gid: Optional[int] = None) -> VolumeFileInfo:
        req: Dict[str, Any] = {"path": path}
        for k, v in (("mode", mode), ("uid", uid), ("gid", gid)):
            if v is not None:
                req[k] = int(v)
        return VolumeFileInfo._from(self._call("SetVolumePathAttrs", req))


def _chunks(data: Union[bytes, str, IO[bytes]], size: int) -> Iterator[bytes]:
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, (bytes, bytearray)):
        for i in range(0, len(data), size):
            yield bytes(data[i:i + size])
        return
    while True:
        b = data.read(size)
        if not b:
            return
        yield b


