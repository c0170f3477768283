"""verl integration: a ``BaseTool`` for tool-calling agent loops, and the
SandboxFusion URL for verl's code reward.

Reward (no code change in verl)::

    reward_model.sandbox_fusion.url = sandbox_fusion_url()   # http://HOST:7070/run_code

Tool (in the tools config, class_name: dsec.adapters.verl.DsecTool)::

    tool = DsecTool(config={"image": "debian", "timeout": 30}, tool_schema=None)
    instance_id, _ = await tool.create()
    response, reward, metrics = await tool.execute(instance_id, {"code": "print(1)"})
    await tool.release(instance_id)
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..client import Client, Sandbox
from ..errors import DsecError


def sandbox_fusion_url(base: Optional[str] = None) -> str:
    """The URL for ``reward_model.sandbox_fusion.url``."""
    return (base or os.environ.get("DSEC_URL") or "http://127.0.0.1:7070").rstrip("/") + "/run_code"


@dataclass
class ToolResponse:
    text: Optional[str] = None
    image: Any = None
    video: Any = None


_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code in a persistent sandbox; print() what you want to see.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python code"}}, "required": ["code"]},
    },
}


class DsecTool:
    """A verl tool with one sandbox per trajectory: state (files) persists
    across the trajectory's calls; ``release`` deletes the sandbox."""

    def __init__(self, config: Optional[Dict[str, Any]] = None, tool_schema: Any = None) -> None:
        self.config = config or {}
        self.tool_schema = tool_schema or _SCHEMA
        self.client = Client(self.config.get("url"), self.config.get("api_key"))
        self.timeout = float(self.config.get("timeout", 30))
        self.max_output = int(self.config.get("max_tool_response_length", 8000))
        self.instances: Dict[str, Sandbox] = {}
        self.steps: Dict[str, int] = {}

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs: Any) -> Tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        labels = {"verl-trajectory": instance_id[:63]}
        sb = await asyncio.to_thread(self.client.create, image=self.config.get("image", "debian"), labels=labels,
                                     ttl_s=int(self.config.get("ttl_s", 3600)))
        self.instances[instance_id] = sb
        self.steps[instance_id] = 0
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: Dict[str, Any], **kwargs: Any) -> Tuple[ToolResponse, float, Dict[str, Any]]:
        sb = self.instances[instance_id]
        step = self.steps[instance_id]
        self.steps[instance_id] = step + 1
        code = parameters.get("code", "")
        try:
            await asyncio.to_thread(sb.write_file, f"/tmp/verl_{step}.py", code)
            # The request ID makes a retried tool call exactly-once.
            r = await asyncio.to_thread(sb.exec, ["python3", f"/tmp/verl_{step}.py"], timeout_s=self.timeout,
                                        request_id=f"{instance_id}/{step}")
        except DsecError as e:
            return ToolResponse(text=f"Error when executing tool: {e}"), 0.0, {"infra": e.infra}
        text = r.stdout + (("\n" + r.stderr) if r.stderr else "")
        if len(text) > self.max_output:
            half = self.max_output // 2
            text = text[:half] + "\n...\n" + text[-half:]
        return ToolResponse(text=text), 0.0, {"exit_code": r.exit_code, "timed_out": r.timed_out, "replayed": r.replayed}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        sb = self.instances.pop(instance_id, None)
        self.steps.pop(instance_id, None)
        if sb is not None:
            try:
                await asyncio.to_thread(sb.close)
            except DsecError:
                pass
