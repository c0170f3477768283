import asyncio

import dsec


def test_run_code_python_and_statuses(client):
    r = client.run_code("print(sum(range(1000)))")
    assert r.ok and r.stdout == "499500\n" and r.exit_code == 0 and not r.infra
    assert client.run_code("1/0").status == "runtime_error"
    assert client.run_code("while True: pass", run_timeout=1).status == "time_limit_exceeded"
    assert client.run_code("int main(", language="c").status == "compile_error"


def test_run_code_stdin_files_and_fetch(client):
    r = client.run_code("import sys; open('o.txt','w').write(sys.stdin.read() + open('i.txt').read())",
                        stdin="a", files={"i.txt": "b"}, fetch_files=["o.txt"])
    assert r.ok and r.files["o.txt"] == b"ab"


def test_judging(client):
    r = client.run_code("a, b = map(int, input().split()); print(a + b)",
                        tests=[("1 2", "3"), {"stdin": "2 2", "expected_stdout": "5"}])
    assert r.status == "wrong_answer" and (r.passed, r.total) == (1, 2) and r.pass_rate == 0.5
    assert [c.passed for c in r.cases] == [True, False]


def test_batch_keeps_order(client):
    rs = client.run_code_batch([{"code": f"print({i})"} for i in range(10)] + [{"code": "x", "language": "cobol"}])
    assert [r.stdout.strip() for r in rs[:10]] == [str(i) for i in range(10)]
    assert rs[10].status == "invalid_request" and not rs[10].infra


def test_async_client_is_not_bound_to_a_loop(server):
    ac = dsec.AsyncClient(server.url)

    async def once():
        r = await ac.run_code("print('x')")
        sb = await ac.create(image="busybox")
        out = (await sb.exec("echo y")).stdout
        await sb.close()
        rs = await ac.run_code_many([{"code": f"print({i})"} for i in range(8)], concurrency=4)
        return r.stdout, out, [x.stdout for x in rs]

    for _ in range(2):  # a fresh loop each time
        a, b, c = asyncio.run(once())
        assert (a, b) == ("x\n", "y\n") and c == [f"{i}\n" for i in range(8)]


def test_run_code_checkers_and_args(client):
    cases = [{"stdin": f"{n}\n", "expected_stdout": f"1 {n - 1}\n"} for n in range(2, 8)]
    split = "n = int(input()); print(n - 1, 1)"
    # The expected split is one of many: exact judging refuses another.
    assert client.run_code(split, tests=cases).status == "wrong_answer"
    checker = dsec.Checker(language="python", code=(
        "import sys\n"
        "n = int(open(sys.argv[1]).read()); a, b = map(int, open(sys.argv[3]).read().split())\n"
        "sys.exit(0 if a > 0 and b > 0 and a + b == n else 1)\n"))
    r = client.run_code(split, tests=cases, checker=checker)
    assert r.status == "success" and r.passed == 6, r
    r = client.run_code("n = int(input()); print(n, 0)", tests=cases, checker=checker)
    assert r.status == "wrong_answer" and r.first_failure is not None and r.first_failure.index == 0
    r = client.run_code("print(1/3)", tests=[("", "0.3333333")], checker="float", float_tolerance=1e-6)
    assert r.ok
    r = client.run_code("print(1)", tests=[("", "1")], checker={"language": "python", "code": "raise SystemExit(3)"})
    assert r.status == "judge_error" and r.masked and not r.infra
    r = client.run_code("import sys; print(' '.join(sys.argv[1:]))", args=["a", "b"])
    assert r.stdout == "a b\n"
