"""dsec in verl: a ``BaseTool`` for the tool agent loop, and the SandboxFusion
URL for verl's code reward.

Written against verl v0.7.0 (``verl/tools/base_tool.py``,
``verl/tools/schemas.py``, ``verl/tools/utils/tool_registry.py``, and the
caller ``verl/experimental/agent_loop/tool_agent_loop.py``). verl builds
tools from its tools config (``multi_turn.tool_config_path``)::

    tools:
      - class_name: dsec.adapters.verl.DsecTool
        config:
          type: native                # verl's ToolType; required by verl
          image: debian               # dsec's keys, below
          timeout: 30
        tool_schema:                  # optional: DsecTool's own schema is code_interpreter
          type: function
          function: {name: code_interpreter, description: ..., parameters: {...}}

It keys tools by ``tool.name`` (the schema's function name), renders
``tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)`` into
the chat template, and for every tool call does ``create(create_kwargs=...)``,
``execute(instance_id, arguments, agent_data=...)``, ``release(instance_id)``.
With verl installed DsecTool subclasses verl's BaseTool and returns verl's
ToolResponse; without it, stand-ins with the same fields.

State: verl's loop creates and releases an instance around each call, so by
default (``state: call``) each call runs in a fresh sandbox that ``release``
deletes. With ``state: trajectory`` the calls of one trajectory (verl's
``agent_data.request_id``) share a sandbox: files and installed packages
persist across turns. verl has no end-of-trajectory hook for tools, so that
sandbox ends ``idle_ttl_s`` after the trajectory's last call (or at
``close_trajectory``/``close``).

Config keys (anything else raises TypeError, naming it): ``type``, ``url``,
``api_key``, ``image``, ``kind``, ``network`` (default none), ``cpu``,
``memory_mb``, ``timeout`` (per call, s), ``ttl_s``, ``idle_ttl_s``,
``state``, ``language`` (python or bash: how ``code`` runs),
``max_output_bytes``. ``create_kwargs`` may carry ``files`` ({path:
content}, written into the sandbox before its first call); other keys are
refused.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..aio import AsyncSandbox
from ..errors import DsecError, NotFound, SandboxGone
from ._common import async_client, reject_unknown

_NAME = "dsec verl tool"

try:
    from verl.tools.base_tool import BaseTool as _Base
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

    VERL = True
except ImportError:
    VERL = False

    class ToolResponse:  # type: ignore[no-redef]
        """verl's ToolResponse (text, image, video)."""

        def __init__(self, text: Optional[str] = None, image: Optional[List[Any]] = None,
                     video: Optional[List[Any]] = None) -> None:
            self.text, self.image, self.video = text, image, video

    @dataclass
    class _Function:
        name: str
        description: str
        parameters: Dict[str, Any]

    class OpenAIFunctionToolSchema:  # type: ignore[no-redef]
        """verl's tool schema, reduced to what its loop reads:
        ``.function.name`` and ``model_dump``."""

        def __init__(self, type: str, function: Mapping[str, Any]) -> None:
            self.type = type
            self.function = _Function(function["name"], function.get("description", ""),
                                      dict(function.get("parameters") or {}))

        @classmethod
        def model_validate(cls, d: Mapping[str, Any]) -> "OpenAIFunctionToolSchema":
            return cls(d["type"], d["function"])

        def model_dump(self, **_: Any) -> Dict[str, Any]:
            return {"type": self.type, "function": {"name": self.function.name,
                                                    "description": self.function.description,
                                                    "parameters": self.function.parameters}}

    class _Base:  # type: ignore[no-redef]
        def __init__(self, config: dict, tool_schema: Any) -> None:
            self.config = config
            self.tool_schema = tool_schema or self.get_openai_tool_schema()
            assert self.tool_schema is not None, "Tool schema is not set!"
            self.name = self.tool_schema.function.name

        def get_openai_tool_schema(self) -> Any:
            return self.tool_schema


def sandbox_fusion_url(base: Optional[str] = None) -> str:
    """The URL for ``reward_model.sandbox_fusion.url``."""
    return (base or os.environ.get("DSEC_URL") or "http://127.0.0.1:7070").rstrip("/") + "/run_code"


_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code in a sandbox; print() what you want to see.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to run."}},
                       "required": ["code"]},
    },
}
_CONFIG = ("type", "url", "api_key", "image", "kind", "network", "cpu", "memory_mb", "timeout", "ttl_s", "idle_ttl_s",
           "state", "language", "max_output_bytes")
_RUN = {"python": ["python3", "-c"], "bash": ["bash", "-c"]}


class DsecTool(_Base):  # type: ignore[misc,valid-type]
    """verl's BaseTool on dsec sandboxes. See the module for the config."""

    def __init__(self, config: dict, tool_schema: Any = None) -> None:
        config = dict(config or {})
        reject_unknown(_NAME + " config", config, _CONFIG)
        if config.get("type", "native") != "native":
            raise TypeError(f"{_NAME}: config type {config['type']!r}: DsecTool is a native tool")
        self.state = config.get("state", "call")
        if self.state not in ("call", "trajectory"):
            raise ValueError(f"{_NAME}: state must be call or trajectory, not {self.state!r}")
        self.language = config.get("language", "python")
        if self.language not in _RUN:
            raise ValueError(f"{_NAME}: language must be one of {', '.join(_RUN)}, not {self.language!r}")
        if tool_schema is None:
            tool_schema = OpenAIFunctionToolSchema.model_validate(_SCHEMA)
        super().__init__(config, tool_schema)
        self.client = async_client(config.get("url"), config.get("api_key"))
        self.timeout = float(config.get("timeout", 30))
        self.max_output_bytes = int(config.get("max_output_bytes", 64 * 1024))
        self._spec: Dict[str, Any] = {"image": config.get("image", "debian"), "kind": config.get("kind", "container"),
                                      "network": config.get("network", "none"),
                                      "ttl_s": int(config.get("ttl_s", 3600))}
        for k in ("cpu", "memory_mb"):
            if config.get(k):
                self._spec[k] = config[k]
        self.idle_ttl_s = int(config.get("idle_ttl_s", 300))
        if self.state == "trajectory":
            self._spec["idle_ttl_s"] = self.idle_ttl_s
        self._instances: Dict[str, Dict[str, Any]] = {}  # instance id -> {"files": ..., "sandbox": ...}
        self._trajectories: Dict[str, AsyncSandbox] = {}
        self._creating: Dict[str, "asyncio.Future[AsyncSandbox]"] = {}
        self._seeded: set = set()

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs: Any) -> Tuple[str, ToolResponse]:
        """A tool instance. ``create_kwargs`` (verl's per-sample tool
        arguments) may give ``files`` to write into its sandbox."""
        create_kwargs = dict(kwargs.pop("create_kwargs", None) or {})
        reject_unknown(_NAME + " create", kwargs)
        reject_unknown(_NAME + " create_kwargs", create_kwargs, ("files",))
        instance_id = instance_id or str(uuid.uuid4())
        inst: Dict[str, Any] = {"files": dict(create_kwargs.get("files") or {}), "sandbox": None}
        if self.state == "call":
            inst["sandbox"] = await self.client.create(labels={"verl-tool": self.name[:63]}, **self._spec)
        self._instances[instance_id] = inst
        return instance_id, ToolResponse()

    async def _sandbox(self, inst: Dict[str, Any], agent_data: Any) -> AsyncSandbox:
        if inst["sandbox"] is not None:
            return inst["sandbox"]
        key = str(getattr(agent_data, "request_id", "") or "")
        if not key:
            raise TypeError(f"{_NAME}: state trajectory needs verl's agent_data (with its request_id) in execute")
        sb = self._trajectories.get(key)
        if sb is None:
            fut = self._creating.get(key)
            if fut is None:
                fut = self._creating[key] = asyncio.ensure_future(
                    self.client.create(labels={"verl-tool": self.name[:63], "verl-request": key[:63]}, **self._spec))
            try:
                sb = await asyncio.shield(fut)
            finally:
                self._creating.pop(key, None)
            self._trajectories[key] = sb
        inst["sandbox"] = sb
        return sb

    async def execute(self, instance_id: str, parameters: Dict[str, Any], **kwargs: Any) -> Tuple[ToolResponse, float, Dict[str, Any]]:
        """Run ``parameters["code"]``; the response is its stdout, then its
        stderr. An infrastructure failure (the sandbox died) is an error
        response with ``metrics["infra"] = True``, for the trainer to mask."""
        inst = self._instances[instance_id]
        unknown = set(parameters) - {"code"}
        if unknown or "code" not in parameters:
            return ToolResponse(text=f"Error: {self.name} takes exactly one argument, code"), 0.0, {"invalid": True}
        try:
            sb = await self._sandbox(inst, kwargs.get("agent_data"))
            if inst["files"] and sb.id not in self._seeded:
                # Once per sandbox: a trajectory's later calls find the
                # files as its earlier calls left them.
                self._seeded.add(sb.id)
                for path, content in inst["files"].items():
                    await sb.write_file(path, content)
            r = await sb.exec([*_RUN[self.language], str(parameters["code"])], timeout_s=self.timeout,
                              max_output_bytes=self.max_output_bytes)
        except DsecError as e:
            return ToolResponse(text=f"Error when executing tool: {e}"), 0.0, {"infra": e.infra}
        text = r.stdout + (r.stderr if r.stderr else "")
        if r.timed_out:
            text += f"\n[timed out after {self.timeout:g}s]"
        return ToolResponse(text=text), 0.0, {"exit_code": r.exit_code, "timed_out": r.timed_out,
                                              "duration_ms": r.duration_ms}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """End the instance: with state call, delete its sandbox (a sandbox
        already gone is not an error)."""
        inst = self._instances.pop(instance_id, None)
        if inst is None or self.state != "call" or inst["sandbox"] is None:
            return
        self._seeded.discard(inst["sandbox"].id)
        try:
            await inst["sandbox"].close()
        except (SandboxGone, NotFound):
            pass

    async def close_trajectory(self, request_id: str) -> None:
        """Delete a trajectory's sandbox now (state trajectory)."""
        sb = self._trajectories.pop(str(request_id), None)
        if sb is not None:
            self._seeded.discard(sb.id)
            try:
                await sb.close()
            except (SandboxGone, NotFound):
                pass

    async def close(self) -> None:
        """Delete every sandbox this tool holds."""
        for key in list(self._trajectories):
            await self.close_trajectory(key)
        for iid in list(self._instances):
            await self.release(iid)


__all__ = ["DsecTool", "ToolResponse", "OpenAIFunctionToolSchema", "sandbox_fusion_url", "VERL"]
