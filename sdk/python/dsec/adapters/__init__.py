"""Adapters that implement RL frameworks' own sandbox interfaces on dsec:

- :mod:`dsec.adapters.verl` — verl ``BaseTool`` (and the SandboxFusion URL for verl's reward)
- :mod:`dsec.adapters.harbor` — Harbor ``BaseEnvironment``
- :mod:`dsec.adapters.swerex` — SWE-ReX ``AbstractDeployment`` and ``AbstractRuntime``
- :mod:`dsec.adapters.rock` — ROCK's ``Sandbox`` client (what ROLL drives)
- :mod:`dsec.adapters.tinker` — tinker-cookbook ``SandboxInterface`` and harbor_rl's ``SandboxFactory``
- :mod:`dsec.adapters.rllm` — rLLM ``Sandbox``, registered by name
- :mod:`dsec.adapters.open_instruct` — open-instruct ``SandboxBackend``, registered by name

Each imports the framework's own base classes, result types and exceptions
when the framework is installed, and defines stand-ins with the same names
and fields when it is not (no framework is a dependency). Each maps dsec's
"sandbox gone" (infra) errors to the framework's own terminal error, refuses
options it cannot honour (``UnsupportedOption``, naming them) and keywords it
does not understand (``TypeError``). See docs/rl.md.
"""
