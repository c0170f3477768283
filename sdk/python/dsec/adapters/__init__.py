"""Thin adapters that satisfy RL frameworks' sandbox contracts by duck
typing, without importing the frameworks:

- :mod:`dsec.adapters.tinker` — tinker-cookbook ``SandboxInterface``
- :mod:`dsec.adapters.open_instruct` — open-instruct ``SandboxBackend``
- :mod:`dsec.adapters.rllm` — rLLM ``Sandbox``
- :mod:`dsec.adapters.harbor` — Harbor ``BaseEnvironment``
- :mod:`dsec.adapters.swerex` — SWE-ReX-style runtime with bash sessions
- :mod:`dsec.adapters.verl` — a verl ``BaseTool`` and the SandboxFusion URL for verl's reward

Each maps the framework's verbs onto one dsec sandbox and maps dsec's
"sandbox gone" (infra) errors to the framework's own terminal error, so
trainers mask infrastructure failures instead of scoring them.
"""
