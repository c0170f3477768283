"""The verl adapter driven as verl v0.7's tool agent loop drives tools:
built from the tools config as ``initialize_tools_from_config`` builds them
(``class_name`` imported by module path, ``config.type`` parsed as verl's
ToolType, ``tool_schema`` validated into OpenAIFunctionToolSchema or None),
keyed by ``tool.name``, schemas rendered with ``model_dump(exclude_unset=True,
exclude_none=True)``, and every call made as ``ToolAgentLoop._call_tool``
makes it: ``create(create_kwargs=...)``, ``execute(instance_id, args,
agent_data=...)``, ``release(instance_id)`` in a finally, across a batch of
concurrent trajectories. verl is not installed here: ToolResponse and the
schema are the adapter's stand-ins."""

import asyncio
import importlib
import json

import pytest

from dsec.adapters import verl

CODE_TOOL = {
    "class_name": "dsec.adapters.verl.DsecTool",
    "config": {"type": "native", "image": "debian", "timeout": 10},
    "tool_schema": {
        "type": "function",
        "function": {"name": "code_interpreter", "description": "A tool for executing code.",
                     "parameters": {"type": "object", "properties": {"code": {"type": "string",
                                                                              "description": "The code to execute."}},
                                    "required": ["code"]}},
    },
}


def initialize_tools(tools_config):
    """verl's initialize_tools_from_config, for native tools."""
    tools = []
    for tc in tools_config["tools"]:
        module, _, cls_name = tc["class_name"].rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        assert tc["config"]["type"] == "native"  # ToolType(tool_config.config.type)
        schema = tc.get("tool_schema")
        schema = None if schema is None else verl.OpenAIFunctionToolSchema.model_validate(schema)
        tools.append(cls(config=dict(tc["config"]), tool_schema=schema))
    return tools


class AgentData:
    def __init__(self, request_id):
        self.request_id = request_id


async def call_tool(tools, name, arguments, agent_data, tools_kwargs=None):
    """ToolAgentLoop._call_tool."""
    tool, instance_id = None, None
    try:
        tool = tools[name]
        kwargs = (tools_kwargs or {}).get(name, {})
        instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
        response, reward, metrics = await tool.execute(instance_id, json.loads(arguments), agent_data=agent_data)
    except Exception as e:
        return verl.ToolResponse(text=f"Error when executing tool: {e}"), 0.0, {}
    finally:
        if tool and instance_id:
            await tool.release(instance_id)
    return response, reward, metrics


def test_verls_agent_loop_creates_executes_and_releases_across_a_batch(server, client):
    tools = {t.name: t for t in initialize_tools({"tools": [CODE_TOOL]})}
    schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tools.values()]
    assert list(tools) == ["code_interpreter"] and schemas[0]["function"]["name"] == "code_interpreter"

    async def trajectory(i):
        data = AgentData(f"req-{i}")
        kw = {"code_interpreter": {"create_kwargs": {"files": {"/work/input.txt": f"{i}\n"}}}}
        r1, reward, m1 = await call_tool(tools, "code_interpreter",
                                         json.dumps({"code": "print(int(open('/work/input.txt').read()) * 7)"}), data, kw)
        r2, _, m2 = await call_tool(tools, "code_interpreter",
                                    json.dumps({"code": "import sys; print('oops', file=sys.stderr); raise SystemExit(3)"}), data)
        r3, _, m3 = await call_tool(tools, "code_interpreter", json.dumps({"code": "while True: pass"}), data)
        return r1.text, reward, m1["exit_code"], r2.text, m2["exit_code"], m3["timed_out"]

    async def batch():
        return await asyncio.gather(*(trajectory(i) for i in range(4)))

    for i, (t1, reward, c1, t2, c2, timed_out) in enumerate(asyncio.run(batch())):
        assert (t1, reward, c1) == (f"{i * 7}\n", 0.0, 0)
        assert (t2, c2) == ("oops\n", 3)
        assert timed_out
    # state "call": every instance's sandbox went with its release.
    assert client.list(labels={"verl-tool": "code_interpreter"}) == []


def test_a_trajectory_keeps_one_sandbox_across_its_calls_with_state_trajectory(server, client):
    cfg = dict(CODE_TOOL, config={**CODE_TOOL["config"], "state": "trajectory", "idle_ttl_s": 120})
    del cfg["tool_schema"]  # the tool's own schema
    tools = {t.name: t for t in initialize_tools({"tools": [cfg]})}
    tool = tools["code_interpreter"]

    async def trajectory(i):
        data = AgentData(f"traj-{i}")
        await call_tool(tools, "code_interpreter", json.dumps({"code": f"open('/tmp/state','w').write('{i}')"}), data)
        r, _, _ = await call_tool(tools, "code_interpreter", json.dumps({"code": "print(open('/tmp/state').read())"}), data)
        return r.text

    async def batch():
        try:
            texts = await asyncio.gather(*(trajectory(i) for i in range(3)))
            held = len(client.list(labels={"verl-tool": "code_interpreter"}))
            return texts, held
        finally:
            await tool.close()

    texts, held = asyncio.run(batch())
    assert texts == ["0\n", "1\n", "2\n"] and held == 3
    assert client.list(labels={"verl-tool": "code_interpreter"}) == []


def test_config_and_arguments_dsec_does_not_understand_are_refused(server):
    with pytest.raises(TypeError, match="sandbox_fusion_url"):
        verl.DsecTool(config={"type": "native", "sandbox_fusion_url": "http://x/run_code"})
    with pytest.raises(TypeError, match="mcp"):
        verl.DsecTool(config={"type": "mcp"})
    tool = verl.DsecTool(config={"type": "native"})

    async def go():
        with pytest.raises(TypeError, match="ground_truth"):
            await tool.create(create_kwargs={"ground_truth": "42"})
        iid, _ = await tool.create()
        try:
            r, _, m = await tool.execute(iid, {"code": "print(1)", "language": "rust"})
            return r.text, m
        finally:
            await tool.release(iid)

    text, metrics = asyncio.run(go())
    assert "exactly one argument" in text and metrics == {"invalid": True}


def test_the_sandbox_fusion_url_for_verls_reward(server):
    assert verl.sandbox_fusion_url(server.url) == server.url + "/run_code"
