"""Sidecars and Compose files: a sandbox of several containers.

A sandbox may hold sidecars beside its main container (a database, a
service under test, an MCP server): each from its own image, with its own
command, environment, file system and processes, all sharing one network
namespace, so they reach each other on localhost and by name. Give them to
``Client.create`` as ``sidecars=[...]`` (dicts with the keys below) or as a
Compose file (``compose=...``: its service ``main``, or its only one, is the
main container). ``Sandbox.container(name)`` is a handle whose exec and
file calls act in a sidecar; ``.logs()`` on it follows the sidecar's output.

A sidecar dict: ``name``, ``image`` (required), ``command`` and
``entrypoint`` (argv lists, Docker's meaning; default the image's), ``env``,
``workdir``, ``user``, ``cpu``, ``memory_mb``, ``pids``, ``disk_mb``,
``aliases`` (further names), ``volumes`` (mounts of the sandbox's
``shared_volumes``: ``"name:/path[:ro]"``), ``depends_on`` (names, or dicts with ``name``
and ``condition``: "started", "healthy" or "completed"), ``healthcheck``
(a dict: ``command`` argv, ``interval_ms``, ``timeout_ms``,
``start_period_ms``, ``start_interval_ms``, ``retries``)."""

import re
from typing import Any, Dict, Mapping, Optional

__all__ = ["interpolate", "sidecar_wire", "shared_volume_wire"]

_VAR = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}|[A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: Optional[Mapping[str, str]] = None) -> str:
    """Substitute variables in a Compose file as Compose does: ``$VAR`` and
    ``${VAR}`` (empty if unset), ``${VAR:-default}`` (if unset or empty),
    ``${VAR-default}`` (if unset), ``${VAR:?message}`` and
    ``${VAR?message}`` (a ValueError if unset, or empty with the colon),
    ``${VAR:+other}`` and ``${VAR+other}``, and ``$$`` for a literal
    ``$``. ``env`` defaults to ``os.environ``; the server never sees it."""
    if env is None:
        import os
        env = os.environ

    def sub(m: "re.Match[str]") -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(2), m.group(3), m.group(4) or ""
        if name is None:
            name = m.group(1)
        is_set = name in env
        val = env.get(name, "")
        if not op:
            return val
        if op == ":-":
            return arg if val == "" else val
        if op == "-":
            return val if is_set else arg
        if op in (":?", "?"):
            if not is_set or (op == ":?" and val == ""):
                raise ValueError(f"compose file: required variable {name} is missing: {arg}")
            return val
        if op == ":+":
            return arg if val != "" else ""
        return arg if is_set else ""  # "+"

    return _VAR.sub(sub, text)


_KEYS = {"name", "image", "command", "entrypoint", "env", "workdir", "user", "cpu", "memory_mb", "pids",
         "disk_mb", "aliases", "depends_on", "healthcheck", "volumes"}
_HEALTH = {"command": "command", "interval_ms": "intervalMs", "timeout_ms": "timeoutMs",
           "start_period_ms": "startPeriodMs", "start_interval_ms": "startIntervalMs", "retries": "retries"}


def sidecar_wire(d: Mapping[str, Any]) -> Dict[str, Any]:
    """A sidecar dict (see the module's doc) as the API takes it. Unknown
    keys are a ValueError, never dropped."""
    unknown = set(d) - _KEYS
    if unknown:
        raise ValueError(f"sidecar {d.get('name')!r}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    out: Dict[str, Any] = {"name": str(d["name"]), "image": str(d["image"])}
    for k in ("command", "entrypoint", "aliases"):
        if d.get(k):
            if isinstance(d[k], str):
                raise ValueError(f"sidecar {d['name']!r}: {k} is a list of strings (argv), not a string")
            out[k] = [str(a) for a in d[k]]
    if d.get("env"):
        out["env"] = {str(k): str(v) for k, v in d["env"].items()}
    if d.get("workdir"):
        out["workdir"] = str(d["workdir"])
    if d.get("user"):
        out["user"] = str(d["user"])
    res: Dict[str, Any] = {}
    if d.get("cpu"):
        res["cpu"] = float(d["cpu"])
    for k, w in (("memory_mb", "memoryMb"), ("pids", "pids"), ("disk_mb", "diskMb")):
        if d.get(k):
            res[w] = str(int(d[k]))
    if res:
        out["resources"] = res
    if d.get("volumes"):
        from .volumes import mount_wire
        out["volumes"] = [mount_wire(m) for m in d["volumes"]]
    deps = []
    for dep in d.get("depends_on") or []:
        if isinstance(dep, str):
            deps.append({"name": dep})
        else:
            deps.append({"name": str(dep["name"]), "condition": str(dep.get("condition", "started"))})
    if deps:
        out["dependsOn"] = deps
    hc = d.get("healthcheck")
    if hc:
        unknown = set(hc) - set(_HEALTH)
        if unknown:
            raise ValueError(f"sidecar {d['name']!r}: unknown healthcheck keys {sorted(unknown)}")
        w: Dict[str, Any] = {}
        for k, v in hc.items():
            if k == "command":
                w["command"] = [str(a) for a in v]
            elif k == "retries":
                w["retries"] = int(v)
            else:
                w[_HEALTH[k]] = str(int(v))
        out["healthcheck"] = w
    return out


def shared_volume_wire(v: Any) -> Dict[str, Any]:
    """A shared volume (a file system of the sandbox alone, which its
    containers mount by name) as the API takes it: a name, or a dict with
    ``name`` and ``size_mb``."""
    if isinstance(v, str):
        return {"name": v}
    out: Dict[str, Any] = {"name": str(v["name"])}
    if v.get("size_mb"):
        out["sizeMb"] = str(int(v["size_mb"]))
    return out
