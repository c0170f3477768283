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
