"""Function calls: run a program on inputs in a warm pooled worker."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Union

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

_FUNCTION = "dsec.v1.FunctionService"

#: statuses that are the program's own outcome (score them)
PROGRAM_STATUSES = ("success", "wrong_answer", "compile_error", "runtime_error", "time_limit_exceeded", "memory_limit_exceeded")

#: statuses that say nothing about the program (mask them): the platform
#: failed (``infra`` is set), or the checker program did
MASKED_STATUSES = ("sandbox_error", "judge_error")

#: built-in checkers (``checker="float"`` etc.)
BUILTIN_CHECKERS = ("lines", "exact", "tokens", "float", "unordered_lines", "case_insensitive")


@dataclass
class Checker:
    """A special judge: a built-in comparison (``builtin``, one of
    BUILTIN_CHECKERS, with ``float_tolerance`` for "float") or a program
    (``language`` and ``code``) run per test case as ``checker input
    expected actual`` (three files): exit 0 accepts, 1 or 2 is a wrong
    answer, anything else a judge_error."""

    builtin: str = ""
    float_tolerance: float = 0.0
    language: str = ""
    code: str = ""
    timeout: Optional[float] = None

    def _wire(self) -> Dict[str, Any]:
        m: Dict[str, Any] = {}
        if self.code:
            m["language"], m["code"] = self.language or "python", self.code
            if self.timeout:
                m["timeoutS"] = float(self.timeout)
        else:
            m["builtin"] = self.builtin or "lines"
            if self.float_tolerance:
                m["floatTolerance"] = float(self.float_tolerance)
        return m


@dataclass
class Stage:
    status: str
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    truncated: bool = False
    signal: str = ""

    @classmethod
    def _from(cls, m: Optional[Dict[str, Any]]) -> Optional["Stage"]:
        if not m:
            return None
        return cls(status=m.get("status", ""), exit_code=int(m.get("exitCode") or 0), stdout=m.get("stdout", ""),
                   stderr=m.get("stderr", ""), duration_s=float(m.get("durationS") or 0), truncated=bool(m.get("truncated")),
                   signal=m.get("signal", ""))


@dataclass
class CaseResult:
    index: int
    passed: bool
    status: str
    run: Optional[Stage] = None
    name: str = ""
    checker: Optional[Stage] = None
    checker_message: str = ""

    @classmethod
    def _from(cls, c: Dict[str, Any]) -> "CaseResult":
        return cls(index=int(c.get("index") or 0), passed=bool(c.get("passed")), status=c.get("status", ""),
                   run=Stage._from(c.get("run")), name=c.get("name", ""), checker=Stage._from(c.get("checker")),
                   checker_message=c.get("checkerMessage", ""))


@dataclass
class RunCodeResult:
    """``status`` is success, wrong_answer, compile_error, runtime_error,
    time_limit_exceeded, memory_limit_exceeded — or sandbox_error with
    ``infra`` set, or judge_error (the checker program failed): mask those,
    don't score them (``masked``). With tests, the status is the first
    failing case's (``first_failure``)."""

    status: str
    infra: bool = False
    message: str = ""
    compile: Optional[Stage] = None
    run: Optional[Stage] = None
    cases: List[CaseResult] = field(default_factory=list)
    passed: int = 0
    total: int = 0
    files: Dict[str, bytes] = field(default_factory=dict)
    duration_s: float = 0.0
    first_failure: Optional[CaseResult] = None
    checker_compile: Optional[Stage] = None
    language: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "success"

    @property
    def masked(self) -> bool:
        """True when the result says nothing about the program."""
        return self.infra or self.status in MASKED_STATUSES

    @property
    def stdout(self) -> str:
        return self.run.stdout if self.run else ""

    @property
    def stderr(self) -> str:
        return self.run.stderr if self.run else ""

    @property
    def exit_code(self) -> Optional[int]:
        return self.run.exit_code if self.run else None

    return_code = exit_code

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else float(self.ok)

    @classmethod
    def _from(cls, m: Dict[str, Any]) -> "RunCodeResult":
        cases = [CaseResult._from(c) for c in m.get("cases", [])]
        files = {k: base64.b64decode(v) for k, v in (m.get("files") or {}).items()}
        ff = m.get("firstFailure")
        return cls(status=m.get("status", ""), infra=bool(m.get("infra")), message=m.get("message", ""),
                   compile=Stage._from(m.get("compile")), run=Stage._from(m.get("run")), cases=cases,
                   passed=int(m.get("passed") or 0), total=int(m.get("total") or 0), files=files,
                   duration_s=float(m.get("durationS") or 0), first_failure=CaseResult._from(ff) if ff else None,
                   checker_compile=Stage._from(m.get("checkerCompile")), language=m.get("language", ""))


def _request(code: str, language: str = "python", *, stdin: Optional[str] = None,
             files: Optional[Mapping[str, Union[bytes, str]]] = None, fetch_files: Optional[Sequence[str]] = None,
             tests: Optional[Sequence[Any]] = None, run_timeout: Optional[float] = None,
             compile_timeout: Optional[float] = None, memory_limit_mb: Optional[int] = None,
             max_output_bytes: Optional[int] = None, case_insensitive: bool = False, float_tolerance: float = 0.0,
             stop_on_first_failure: bool = False, image: Optional[str] = None,
             checker: Union[None, str, Checker, Mapping[str, Any]] = None,
             args: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    req: Dict[str, Any] = {"language": language, "code": code}
    if args:
        req["args"] = [str(a) for a in args]
    if checker is not None:
        if isinstance(checker, str):
            checker = Checker(builtin=checker, float_tolerance=float_tolerance)
        elif isinstance(checker, Mapping):
            checker = Checker(**checker)
        req["checker"] = checker._wire()
    if stdin is not None:
        req["stdin"] = stdin
    if files:
        req["files"] = {k: base64.b64encode(v.encode() if isinstance(v, str) else v).decode() for k, v in files.items()}
    if fetch_files:
        req["fetchFiles"] = list(fetch_files)
    if run_timeout:
        req["runTimeoutS"] = float(run_timeout)
    if compile_timeout:
        req["compileTimeoutS"] = float(compile_timeout)
    if memory_limit_mb:
        req["memoryLimitMb"] = str(int(memory_limit_mb))
    if max_output_bytes:
        req["maxOutputBytes"] = str(int(max_output_bytes))
    if image:
        req["image"] = image
    if tests:
        cases = []
        for t in tests:
            if isinstance(t, Mapping):
                cases.append({"stdin": t.get("stdin", t.get("input", "")),
                              "expectedStdout": t.get("expected_stdout", t.get("output", t.get("expected", ""))),
                              "name": str(t.get("name", ""))})
            else:  # (stdin, expected) pairs
                cases.append({"stdin": t[0], "expectedStdout": t[1]})
        req["tests"] = cases
        req["judge"] = {"caseInsensitive": case_insensitive, "floatTolerance": float_tolerance,
                        "stopOnFirstFailure": stop_on_first_failure}
    return req


def run_code(client: "Client", code: str, language: str = "python", **kw: Any) -> RunCodeResult:
    timeout = (kw.get("compile_timeout") or 10) + (kw.get("run_timeout") or 10) * max(1, len(kw.get("tests") or [])) + 60
    m = client._t.unary(_FUNCTION, "RunCode", _request(code, language, **kw), timeout=timeout, retry=True)
    return RunCodeResult._from(m)


def run_code_batch(client: "Client", calls: Sequence[Mapping[str, Any]]) -> List[RunCodeResult]:
    reqs = []
    for c in calls:
        c = dict(c)
        code = c.pop("code")
        language = c.pop("language", "python")
        reqs.append(_request(code, language, **c))
    m = client._t.unary(_FUNCTION, "RunCodeBatch", {"calls": reqs}, timeout=3600, retry=True)
    return [RunCodeResult._from(r) for r in m.get("results", [])]
