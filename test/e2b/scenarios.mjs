// Scenarios that drive dsec with the unmodified e2b and
// @e2b/code-interpreter SDKs; e2b_test.go runs each one as
// `node scenarios.mjs <name>` against a dsec it started. A scenario throws
// (and the process exits 1) when dsec does not behave as E2B does.
//
// Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (the dsec server),
// TEMPLATE and CI_TEMPLATE (the templates to create, which select the kind),
// COUNT (concurrent-creates); for the host names of sandbox ports (the
// server's E2B domain, served over TLS): DSEC_TEST_RESOLVE (resolve.mjs)
// and NODE_EXTRA_CA_CERTS (the server's e2b-ca.pem).
import assert from 'node:assert/strict'
import {
  Sandbox, AuthenticationError, CommandExitError, FileNotFoundError, NotFoundError,
  SandboxError, SandboxNotFoundError, TimeoutError,
} from 'e2b'
import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'
import http from 'node:http'
import { createHash, randomBytes } from 'node:crypto'
// Resolves *.<E2B domain> to the server (DSEC_TEST_RESOLVE): the host
// names getHost returns, without wildcard DNS.
import './resolve.mjs'

const TEMPLATE = process.env.TEMPLATE || 'base'
const CI_TEMPLATE = process.env.CI_TEMPLATE || 'code-interpreter-v1'
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

// until waits for cond (async) to hold, for at most ms, and returns its
// last value. Readiness waits are bounded by time, not a count of tries:
// a full VM under TCG on a loaded 2-core host takes seconds for what a
// container does in milliseconds, and nothing here asserts a duration.
async function until(cond, ms = 90_000) {
  const deadline = Date.now() + ms
  for (;;) {
    const v = await cond()
    if (v || Date.now() > deadline) return v
    await sleep(100)
  }
}

// untilStatus fetches with get until the answer is want (a server in the
// sandbox starting) or ms pass, and returns the last answer.
async function untilStatus(get, want = 200, ms = 90_000) {
  const deadline = Date.now() + ms
  for (;;) {
    const res = await get()
    if (res.status === want || Date.now() > deadline) return res
    await res.text()
    await sleep(200)
  }
}

// gate is a file a command in the sandbox waits for (up to 30 s, then it
// goes on and prints "late"): the test opens it once it has received the
// output printed before the wait, so that output arriving while the
// command still runs shows it streamed, by cause rather than by timing.
function gate(sbx) {
  const path = `/tmp/gate-${randomBytes(6).toString('hex')}`
  let opened
  return {
    sh: `i=0; while [ ! -e ${path} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; [ -e ${path} ] || echo late`,
    py: `import os, time\nfor _ in range(600):\n    if os.path.exists("${path}"): break\n    time.sleep(0.05)\n`,
    path,
    open() {
      opened ??= sbx.files.write(path, '')
      return opened
    },
  }
}
const enc = new TextEncoder()
const dec = new TextDecoder()

// withSandbox creates a sandbox, runs fn, and kills the sandbox.
async function withSandbox(fn, opts = {}) {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000, ...opts })
  try {
    return await fn(sbx)
  } finally {
    await sbx.kill().catch(() => {})
  }
}

async function rejects(promise, cls, what) {
  try {
    await promise
  } catch (e) {
    assert.ok(e instanceof cls, `${what}: got ${e?.name}: ${e?.message}, want ${cls.name}`)
    return e
  }
  assert.fail(`${what}: no error, want ${cls.name}`)
}

const scenarios = {
  // Sandbox.create answers what the SDK needs, and getInfo reports the
  // sandbox with its metadata and template.
  async create() {
    await withSandbox(async (sbx) => {
      assert.match(sbx.sandboxId, /^[a-z0-9-]+$/)
      const info = await sbx.getInfo()
      assert.equal(info.sandboxId, sbx.sandboxId)
      assert.equal(info.templateId, TEMPLATE)
      assert.equal(info.state, 'running')
      assert.equal(info.envdVersion, '0.6.4')
      assert.deepEqual(info.metadata, { job: 'create-test', 'free form key': 'v=1, w' })
      assert.ok(info.endAt > info.startedAt)
      assert.ok(await sbx.isRunning())
      const r = await sbx.commands.run('echo "$GREETING"')
      assert.equal(r.stdout, 'hello from envVars\n')
    }, { metadata: { job: 'create-test', 'free form key': 'v=1, w' }, envs: { GREETING: 'hello from envVars' } })
  },

  // commands.run streams stdout and stderr through the callbacks as the
  // command writes them, and returns the collected result.
  async 'commands-run-streams'() {
    await withSandbox(async (sbx) => {
      // Streamed, not delivered at the end: the command waits, after each
      // line, for the test to have received that line.
      const events = []
      const g1 = gate(sbx), g2 = gate(sbx)
      const r = await sbx.commands.run(`echo one; ${g1.sh}; echo two >&2; ${g2.sh}; echo three`, {
        onStdout: (d) => { events.push(['out', d]); if (d === 'one\n') g1.open() },
        onStderr: (d) => { events.push(['err', d]); if (d === 'two\n') g2.open() },
      })
      await Promise.all([g1.open(), g2.open()])
      assert.equal(r.exitCode, 0)
      assert.equal(r.stdout, 'one\nthree\n', `output was not streamed: ${JSON.stringify(events)}`)
      assert.equal(r.stderr, 'two\n')
      assert.deepEqual(events, [['out', 'one\n'], ['err', 'two\n'], ['out', 'three\n']])
      const cwd = await sbx.commands.run('pwd; echo $FOO', { cwd: '/tmp', envs: { FOO: 'bar' } })
      assert.equal(cwd.stdout, '/tmp\nbar\n')
    })
  },

  // A failing command throws CommandExitError carrying its exit code and
  // stderr.
  async 'commands-run-fails'() {
    await withSandbox(async (sbx) => {
      const e = await rejects(sbx.commands.run('echo partial; echo boom >&2; exit 7'), CommandExitError, 'exit 7')
      assert.equal(e.exitCode, 7)
      assert.equal(e.error, 'exit status 7')
      assert.equal(e.stderr, 'boom\n')
      assert.equal(e.stdout, 'partial\n')
      const missing = await rejects(sbx.commands.run('no-such-command-here'), CommandExitError, 'missing command')
      assert.equal(missing.exitCode, 127)
    })
  },

  // timeoutMs ends the command with TimeoutError and kills it (the
  // request's deadline is the process's lifetime).
  async 'commands-run-timeout'() {
    await withSandbox(async (sbx) => {
      const t0 = Date.now()
      await rejects(sbx.commands.run('sleep 30; echo late', { timeoutMs: 1500 }), TimeoutError, 'timeout')
      const took = Date.now() - t0
      assert.ok(took >= 1400 && took < 10_000, `timed out after ${took} ms`)
      const left = await until(async () => (await sbx.commands.run('pgrep -c -x sleep || true')).stdout.trim() === '0', 30_000)
      assert.ok(left, 'the timed-out command is still running')
    })
  },

  // A background command outlives the client that started it; connect
  // attaches to it again and sees the rest of its output and its exit.
  async 'background-and-connect'() {
    await withSandbox(async (sbx) => {
      let sawEarly
      const early = new Promise((resolve) => { sawEarly = resolve })
      const h = await sbx.commands.run('echo early; sleep 1.5; echo late; exit 3', {
        background: true, onStdout: (d) => { if (d.includes('early')) sawEarly() },
      })
      assert.ok(h.pid > 0)
      await early // "early" is out before the client goes away
      await h.disconnect()
      const running = await sbx.commands.list()
      assert.ok(running.some((p) => p.pid === h.pid && p.cmd === '/bin/bash' && p.args.at(-1).includes('echo early')),
        `background command not listed: ${JSON.stringify(running)}`)
      const again = await sbx.commands.connect(h.pid)
      const e = await rejects(again.wait(), CommandExitError, 'connected wait')
      assert.equal(e.exitCode, 3)
      assert.equal(e.stdout, 'late\n', 'connect must stream only output produced after it')
      const after = await sbx.commands.list()
      assert.ok(!after.some((p) => p.pid === h.pid), 'an exited command is still listed')
      await rejects(sbx.commands.connect(h.pid), NotFoundError, 'connect to an exited command')
    })
  },

  // stdin: sendStdin and closeStdin reach a command started with stdin:
  // true; kill sends SIGKILL and reports whether the process was there.
  async 'commands-stdin-and-kill'() {
    await withSandbox(async (sbx) => {
      const cat = await sbx.commands.run('cat; echo done', { background: true, stdin: true })
      await sbx.commands.sendStdin(cat.pid, 'line one\n')
      await sbx.commands.sendStdin(cat.pid, 'line two\n')
      await sbx.commands.closeStdin(cat.pid)
      assert.equal((await cat.wait()).stdout, 'line one\nline two\ndone\n')
      const noStdin = await sbx.commands.run('cat; echo eof')
      assert.equal(noStdin.stdout, 'eof\n', 'stdin must be closed without stdin: true')
      const sl = await sbx.commands.run('sleep 60', { background: true })
      assert.equal(await sbx.commands.kill(sl.pid), true)
      const e = await rejects(sl.wait(), CommandExitError, 'killed command')
      assert.equal(e.exitCode, -1, 'a killed process ends with exit code -1, as envd reports it')
      assert.equal(e.error, 'signal: killed')
      assert.equal(await sbx.commands.kill(sl.pid), false)
    })
  },

  // A PTY runs an interactive shell: input, output and resize.
  async pty() {
    await withSandbox(async (sbx) => {
      let out = ''
      const t = await sbx.pty.create({ cols: 100, rows: 30, onData: (d) => { out += dec.decode(d) } })
      await sbx.pty.resize(t.pid, { cols: 120, rows: 40 })
      await sbx.pty.sendInput(t.pid, enc.encode('stty size; echo pty-$((6*7)); exit\n'))
      await t.wait().catch(() => {})
      assert.ok(out.includes('pty-42'), `pty output: ${JSON.stringify(out)}`)
      assert.ok(out.includes('40 120'), `resize not applied: ${JSON.stringify(out)}`)
    })
  },

  // files: write (multipart, several files, octet-stream, gzip), read,
  // list, exists, getInfo, makeDir, rename, remove, and the errors the SDK
  // maps.
  async files() {
    await withSandbox(async (sbx) => {
      const w = await sbx.files.write('/tmp/dir/a.txt', 'alpha\n')
      assert.equal(w.path, '/tmp/dir/a.txt')
      assert.equal(w.name, 'a.txt')
      assert.equal(await sbx.files.read('/tmp/dir/a.txt'), 'alpha\n')
      const bytes = new Uint8Array([0, 1, 2, 255])
      await sbx.files.write('/tmp/dir/bin', bytes)
      assert.deepEqual(await sbx.files.read('/tmp/dir/bin', { format: 'bytes' }), bytes)
      const many = await sbx.files.write([{ path: '/tmp/dir/m1', data: 'one' }, { path: '/tmp/dir/sub/m2', data: 'two' }])
      assert.deepEqual(many.map((f) => f.path), ['/tmp/dir/m1', '/tmp/dir/sub/m2'])
      await sbx.files.write('/tmp/dir/octet', 'raw body', { useOctetStream: true })
      assert.equal(await sbx.files.read('/tmp/dir/octet'), 'raw body')
      await sbx.files.write('/tmp/dir/zipped', 'compressed '.repeat(1000), { gzip: true })
      assert.equal(await sbx.files.read('/tmp/dir/zipped'), 'compressed '.repeat(1000))
      await sbx.files.write('/tmp/dir/empty', '')
      assert.equal(await sbx.files.read('/tmp/dir/empty'), '')

      const list = await sbx.files.list('/tmp/dir')
      assert.deepEqual(list.map((e) => [e.name, e.type]).sort(),
        [['a.txt', 'file'], ['bin', 'file'], ['empty', 'file'], ['m1', 'file'], ['octet', 'file'], ['sub', 'dir'], ['zipped', 'file']])
      const a = list.find((e) => e.name === 'a.txt')
      assert.equal(a.size, 6)
      assert.equal(a.path, '/tmp/dir/a.txt')
      assert.equal(a.permissions, '-rw-r--r--')
      assert.ok(a.modifiedTime instanceof Date && Math.abs(a.modifiedTime - Date.now()) < 600_000)
      const deep = await sbx.files.list('/tmp/dir', { depth: 2 })
      assert.ok(deep.some((e) => e.path === '/tmp/dir/sub/m2'), 'depth 2 must list sub/m2')

      assert.equal(await sbx.files.exists('/tmp/dir/a.txt'), true)
      assert.equal(await sbx.files.exists('/tmp/dir/nope'), false)
      assert.equal((await sbx.files.getInfo('/tmp/dir/sub')).type, 'dir')
      assert.equal(await sbx.files.makeDir('/tmp/dir/new/deeper'), true)
      assert.equal(await sbx.files.makeDir('/tmp/dir/new/deeper'), false)

      const moved = await sbx.files.rename('/tmp/dir/a.txt', '/tmp/other/b.txt')
      assert.equal(moved.path, '/tmp/other/b.txt')
      assert.equal(await sbx.files.exists('/tmp/dir/a.txt'), false)
      assert.equal(await sbx.files.read('/tmp/other/b.txt'), 'alpha\n')
      await sbx.files.remove('/tmp/dir')
      assert.equal(await sbx.files.exists('/tmp/dir'), false)

      await rejects(sbx.files.read('/tmp/dir/a.txt'), FileNotFoundError, 'read of a missing file')
      await rejects(sbx.files.list('/tmp/missing'), FileNotFoundError, 'list of a missing directory')
      await sbx.files.remove('/tmp/missing') // succeeds, as envd's (remove-missing)
      await rejects(sbx.files.read('/tmp/other'), SandboxError, 'read of a directory')
      // The command side sees the same files.
      assert.equal((await sbx.commands.run('cat /tmp/other/b.txt')).stdout, 'alpha\n')
    })
  },

  // Signed URLs: the signature replaces the access token on /files.
  async 'signed-urls'() {
    await withSandbox(async (sbx) => {
      await sbx.files.write('/tmp/signed.txt', 'signed content')
      const headers = { 'E2b-Sandbox-Id': sbx.sandboxId }
      const down = await sbx.downloadUrl('/tmp/signed.txt', { useSignatureExpiration: 60 })
      const res = await fetch(down, { headers })
      assert.equal(res.status, 200)
      assert.equal(await res.text(), 'signed content')
      const forged = new URL(down)
      forged.searchParams.set('path', '/etc/shadow')
      assert.equal((await fetch(forged, { headers })).status, 401)
      const up = await sbx.uploadUrl('/tmp/uploaded.txt')
      const form = new FormData()
      form.append('file', new Blob(['via url']), '/tmp/uploaded.txt')
      const put = await fetch(up, { method: 'POST', body: form, headers })
      assert.equal(put.status, 200, await put.text())
      assert.equal(await sbx.files.read('/tmp/uploaded.txt'), 'via url')
    })
  },

  // watchDir reports creations, writes, renames and removals.
  async 'watch-dir'() {
    await withSandbox(async (sbx) => {
      await sbx.files.makeDir('/tmp/watched/sub')
      const events = []
      const w = await sbx.files.watchDir('/tmp/watched', (e) => events.push(`${e.type} ${e.name}`), { recursive: true })
      await sbx.files.write('/tmp/watched/f.txt', 'x')
      await sbx.files.rename('/tmp/watched/f.txt', '/tmp/watched/g.txt')
      await sbx.files.write('/tmp/watched/sub/deep.txt', 'y')
      await sbx.files.remove('/tmp/watched/g.txt')
      const want = ['create f.txt', 'write f.txt', 'rename f.txt', 'create g.txt', 'create sub/deep.txt', 'remove g.txt']
      await until(() => want.every((x) => events.includes(x)), 30_000)
      await w.stop()
      for (const x of want) assert.ok(events.includes(x), `missing "${x}" in ${JSON.stringify(events)}`)
    })
  },

  // Sandbox.list filters by metadata and state, and pages with
  // X-Next-Token.
  async 'list-filters'() {
    const tag = `run-${process.pid}-${Date.now()}`
    const made = await Promise.all([0, 1, 2].map((i) => Sandbox.create(TEMPLATE, {
      timeoutMs: 300_000, metadata: { suite: tag, index: String(i), note: i === 1 ? 'odd one, with = signs' : 'plain' },
    })))
    try {
      const all = await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems()
      assert.deepEqual(all.map((s) => s.sandboxId).sort(), made.map((s) => s.sandboxId).sort())
      assert.equal(all[0].templateId, TEMPLATE)
      assert.equal(all[0].state, 'running')
      const odd = await Sandbox.list({ query: { metadata: { suite: tag, note: 'odd one, with = signs' } } }).nextItems()
      assert.deepEqual(odd.map((s) => s.sandboxId), [made[1].sandboxId])
      assert.equal(odd[0].metadata.index, '1')
      const none = await Sandbox.list({ query: { metadata: { suite: tag, index: '7' } } }).nextItems()
      assert.equal(none.length, 0)

      await made[2].pause()
      const paused = await Sandbox.list({ query: { metadata: { suite: tag }, state: ['paused'] } }).nextItems()
      assert.deepEqual(paused.map((s) => s.sandboxId), [made[2].sandboxId])
      const running = await Sandbox.list({ query: { metadata: { suite: tag }, state: ['running'] } }).nextItems()
      assert.equal(running.length, 2)

      const pager = Sandbox.list({ query: { metadata: { suite: tag } }, limit: 2 })
      const first = await pager.nextItems()
      assert.equal(first.length, 2)
      assert.ok(pager.hasNext, 'a second page must be announced with X-Next-Token')
      const second = await pager.nextItems()
      assert.equal(second.length, 1)
      assert.ok(!pager.hasNext)
      assert.deepEqual([...first, ...second].map((s) => s.sandboxId).sort(), made.map((s) => s.sandboxId).sort())
    } finally {
      await Promise.all(made.map((s) => s.kill()))
    }
  },

  // setTimeout moves the sandbox's end, and a short timeout ends it.
  async 'set-timeout'() {
    await withSandbox(async (sbx) => {
      await sbx.setTimeout(600_000)
      const info = await sbx.getInfo()
      const left = info.endAt.getTime() - Date.now()
      assert.ok(left > 540_000 && left <= 601_000, `endAt ${info.endAt} is ${left} ms away, want ~600 s`)
      await sbx.setTimeout(2_000)
      const soon = (await sbx.getInfo()).endAt.getTime() - Date.now()
      assert.ok(soon <= 2_100, `endAt is ${soon} ms away after setTimeout(2000)`)
      await until(async () => !(await sbx.isRunning()), 60_000)
      assert.equal(await sbx.isRunning(), false, 'the sandbox outlived its timeout')
      await rejects(sbx.getInfo(), SandboxNotFoundError, 'getInfo after the timeout')
    })
  },

  // pause, then connect resumes the sandbox with its files and processes.
  async 'pause-and-connect'() {
    await withSandbox(async (sbx) => {
      await sbx.files.write('/tmp/state.txt', 'kept')
      await sbx.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
      // Its shell runs the login profile first (forks that show the same
      // command line): wait for the sleep itself, then pause.
      const pid = await until(async () => (await sbx.commands.run('pgrep -x sleep || true')).stdout.trim(), 60_000)
      assert.ok(/^\d+$/.test(pid), `the background sleep never started (${pid})`)
      assert.equal(await sbx.pause(), true)
      assert.equal(await sbx.pause(), false, 'pausing a paused sandbox must answer false (409)')
      assert.equal((await sbx.getInfo()).state, 'paused')
      const resumed = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 300_000 })
      assert.equal((await resumed.getInfo()).state, 'running')
      assert.equal(await resumed.files.read('/tmp/state.txt'), 'kept')
      const ps = await resumed.commands.run(`cat /proc/${pid}/comm`)
      assert.equal(ps.stdout.trim(), 'sleep', 'the background process did not survive pause and resume')
      const connected = await resumed.connect()
      assert.equal(connected.sandboxId, sbx.sandboxId)
    })
  },

  // kill returns true once, then false; every later call knows the sandbox
  // is gone.
  async 'kill-twice'() {
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000 })
    assert.equal(await sbx.kill(), true)
    assert.equal(await sbx.kill(), false)
    assert.equal(await Sandbox.kill(sbx.sandboxId), false)
    assert.equal(await sbx.isRunning(), false)
    await rejects(sbx.getInfo(), SandboxNotFoundError, 'getInfo of a killed sandbox')
    await rejects(Sandbox.connect(sbx.sandboxId), SandboxNotFoundError, 'connect to a killed sandbox')
    await rejects(sbx.commands.run('true'), SandboxNotFoundError, 'commands.run in a killed sandbox')
    await rejects(sbx.files.read('/etc/hostname'), TimeoutError, 'files.read in a killed sandbox')
    await rejects(sbx.files.list('/'), TimeoutError, 'files.list in a killed sandbox')
  },

  // fork snapshots a running sandbox into children that start with its
  // files and then diverge.
  async fork() {
    await withSandbox(async (sbx) => {
      await sbx.files.write('/tmp/parent.txt', 'from the parent')
      const children = await sbx.fork({ count: 2, timeoutMs: 120_000 })
      assert.equal(children.length, 2)
      try {
        for (const c of children) assert.ok(!(c instanceof Error), `a fork failed: ${c}`)
        assert.notEqual(children[0].sandboxId, children[1].sandboxId)
        for (const c of children) assert.equal(await c.files.read('/tmp/parent.txt'), 'from the parent')
        await children[0].files.write('/tmp/child.txt', 'only in child 0')
        assert.equal(await children[1].files.exists('/tmp/child.txt'), false)
        assert.equal(await sbx.files.exists('/tmp/child.txt'), false)
        const left = (await children[0].getInfo()).endAt.getTime() - Date.now()
        assert.ok(left > 100_000 && left <= 121_000, `a child ends in ${left} ms, want ~120 s`)
      } finally {
        await Promise.all(children.filter((c) => !(c instanceof Error)).map((c) => c.kill()))
      }
    })
  },

  // Metrics report memory in use and the sandbox's limits.
  async metrics() {
    await withSandbox(async (sbx) => {
      const m = await sbx.getMetrics()
      assert.equal(m.length, 1)
      assert.ok(m[0].memUsed > 0 && m[0].memUsed < m[0].memTotal, JSON.stringify(m))
      assert.equal(m[0].cpuCount, 1)
      assert.ok(m[0].cpuUsedPct >= 0 && m[0].cpuUsedPct <= 100)
    })
  },

  // The code interpreter keeps one Python interpreter per context: globals
  // persist across runCode calls; contexts are isolated; errors, results
  // and streamed output come back as E2B shapes them.
  async 'code-interpreter'() {
    const sbx = await CodeSandbox.create(CI_TEMPLATE, { timeoutMs: 300_000 })
    try {
      const out = []
      const first = await sbx.runCode('import os\nx = 40\nprint("pid", os.getpid())\nprint("hi")', { onStdout: (m) => out.push(m.line) })
      assert.equal(first.error, undefined)
      assert.equal(out.length, 2)
      assert.equal(out[1], 'hi\n')
      const pid = out[0]
      const second = await sbx.runCode('x += 2\nx')
      assert.equal(second.text, '42')
      assert.equal(second.results[0].isMainResult, true)
      const third = await sbx.runCode('import os\nprint("pid", os.getpid())\n{"k": [1, 2]}')
      assert.equal(third.logs.stdout[0], pid, 'the same interpreter process must run every call')
      assert.equal(third.text, "{'k': [1, 2]}")
      const err = await sbx.runCode('def f():\n    raise ValueError("bad value")\nf()')
      assert.equal(err.error.name, 'ValueError')
      assert.equal(err.error.value, 'bad value')
      assert.ok(err.error.traceback.includes('raise ValueError'), err.error.traceback)
      // Streamed as printed: the code waits, after its first line, for
      // the test to have received it.
      const lines = []
      const g = gate(sbx)
      await sbx.runCode(`print("a", flush=True)\n${g.py}print("b" if os.path.exists("${g.path}") else "late")`, {
        onStdout: (m) => { lines.push(m.line); if (m.line === 'a\n') g.open() },
      })
      await g.open()
      assert.deepEqual(lines, ['a\n', 'b\n'], 'runCode output must stream as it is printed')
      const env = await sbx.runCode('import os\nos.environ["ONLY_HERE"]', { envs: { ONLY_HERE: 'yes' } })
      assert.equal(env.text, "'yes'")

      const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
      assert.equal(ctx.language, 'python')
      const isolated = await sbx.runCode('x', { context: ctx })
      assert.equal(isolated.error.name, 'NameError')
      assert.equal((await sbx.runCode('import os\nos.getcwd()', { context: ctx })).text, "'/tmp'")
      await sbx.runCode('y = 1', { context: ctx })
      await sbx.restartCodeContext(ctx)
      assert.equal((await sbx.runCode('y', { context: ctx })).error.name, 'NameError', 'restart must clear the state')
      const ids = (await sbx.listCodeContexts()).map((c) => c.id)
      assert.ok(ids.includes(ctx.id))
      await sbx.removeCodeContext(ctx)
      assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
      await rejects(sbx.runCode('1', { context: ctx }), NotFoundError, 'runCode in a removed context')
      assert.equal((await sbx.runCode('x')).text, '42', 'the default context kept its state')
      // The interpreter is not one of the user's commands.
      assert.ok(!(await sbx.commands.list()).some((p) => p.args.join(' ').includes('exec(sys.argv[1])')))
    } finally {
      await sbx.kill()
    }
  },

  // Many sandboxes created at once through the SDK, with zero errors.
  async 'concurrent-creates'() {
    const count = Number(process.env.COUNT || 100)
    const results = await Promise.allSettled(Array.from({ length: count }, () => Sandbox.create(TEMPLATE, { timeoutMs: 300_000, metadata: { suite: 'concurrent' } })))
    const failed = results.filter((r) => r.status === 'rejected')
    const made = results.filter((r) => r.status === 'fulfilled').map((r) => r.value)
    try {
      assert.equal(failed.length, 0, `${failed.length} of ${count} creates failed, first: ${failed[0]?.reason}`)
      assert.equal(new Set(made.map((s) => s.sandboxId)).size, count)
      const listed = await Sandbox.list({ query: { metadata: { suite: 'concurrent' } }, limit: 1000 }).nextItems()
      assert.equal(listed.length, count)
      const r = await made[count - 1].commands.run('echo alive')
      assert.equal(r.stdout, 'alive\n')
    } finally {
      const kills = await Promise.allSettled(made.map((s) => s.kill()))
      assert.equal(kills.filter((k) => k.status === 'rejected' || k.value !== true).length, 0, 'kill failed')
    }
  },

  // Bad input through the SDK: the typed errors E2B users catch.
  async 'bad-input'() {
    await rejects(Sandbox.create(TEMPLATE, { apiKey: 'e2b_0000000000' }), AuthenticationError, 'create with a wrong API key')
    await rejects(Sandbox.list({ apiKey: 'e2b_0000000000' }).nextItems(), AuthenticationError, 'list with a wrong API key')
    await rejects(Sandbox.connect('aaaaaaaaaaaaaaaa-local'), SandboxNotFoundError, 'connect to an unknown sandbox')
    await rejects(Sandbox.getInfo('not-a-sandbox-id'), SandboxNotFoundError, 'getInfo of a malformed ID')
    assert.equal(await Sandbox.kill('aaaaaaaaaaaaaaaa-local'), false)
    await rejects(Sandbox.create('no-such-image-anywhere'), SandboxError, 'create from an unknown template')
    await withSandbox(async (sbx) => {
      const real = sbx.envdAccessToken
      sbx.envdAccessToken = 'wrong-token'
      await rejects(sbx.commands.run('true'), AuthenticationError, 'commands.run with a wrong access token')
      await rejects(sbx.files.exists('/tmp'), AuthenticationError, 'files.exists with a wrong access token')
      sbx.envdAccessToken = real
      assert.equal((await sbx.commands.run('echo ok')).stdout, 'ok\n')
      // A sandbox created without internet access has no network whose
      // rules could change (rules at create and at runtime: wire_test.go).
      const e = await rejects(sbx.updateNetwork({ allowOut: ['example.com'] }), SandboxError, 'updateNetwork without internet access')
      assert.equal(e.statusCode, 400)
    })
  },
  // A server started in the sandbox answers at getHost(port) (the host
  // name, over the server's TLS listener), and by the E2b-Sandbox-Id /
  // E2b-Sandbox-Port headers and the /sandboxes/<id>/ports/<port>/ path on
  // the plain URL; a streamed answer arrives as it is written, a WebSocket
  // upgrade goes through, and a closed port or a killed sandbox get E2B's
  // 502 bodies.
  async 'user-ports'() {
    await withSandbox(async (sbx) => {
      await sbx.files.write('/tmp/srv/hello.txt', 'hello from the sandbox')
      await sbx.files.write('/tmp/ws.py', WS_SERVER)
      await sbx.commands.run('cd /tmp/srv && exec python3 -m http.server 8000', { background: true })
      await sbx.commands.run('exec python3 /tmp/ws.py 8001', { background: true })
      const host = sbx.getHost(8000)
      assert.equal(host, `8000-${sbx.sandboxId}.${sbx.sandboxDomain}`)
      const base = process.env.E2B_SANDBOX_URL
      const forms = {
        'host name': () => fetch(`https://${host}/hello.txt`),
        headers: () => fetch(`${base}/hello.txt`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000' } }),
        path: () => fetch(`${base}/sandboxes/${sbx.sandboxId}/ports/8000/hello.txt`),
      }
      for (const [form, get] of Object.entries(forms)) {
        const res = await untilStatus(get)
        const text = await res.text()
        assert.equal(res.status, 200, `${form}: ${res.status} ${text}`)
        assert.equal(text, 'hello from the sandbox', form)
      }
      // Streamed: the first line arrives before the server writes the last.
      // The second server may still be starting: a 502 until it listens.
      // The server writes its first line, then waits for the test to
      // have received it before it writes the rest.
      const stream = await untilStatus(() => fetch(`https://${sbx.getHost(8001)}/stream`))
      assert.equal(stream.status, 200)
      const reader = stream.body.getReader()
      const first = dec.decode((await reader.read()).value)
      assert.match(first, /^tick 0/)
      await sbx.files.write('/tmp/stream-go', '')
      let rest = ''
      for (let r = await reader.read(); !r.done; r = await reader.read()) rest += dec.decode(r.value)
      assert.match(rest, /tick 2/)
      assert.ok(!rest.includes('late'), `the stream was not streamed: ${rest}`)
      for (const via of ['host', 'path']) {
        assert.equal(await wsEcho(sbx, 8001, via, 'ping through the proxy'), 'echo: ping through the proxy')
      }
      const closed = await fetch(`https://${sbx.getHost(8999)}/`)
      assert.equal(closed.status, 502)
      assert.deepEqual(await closed.json(), {
        sandboxId: sbx.sandboxId, message: 'The sandbox is running but port is not open', port: '8999', code: 502,
      })
      const url = `https://${host}/hello.txt`
      await sbx.kill()
      for (const gone of [await fetch(url), await fetch(`${base}/sandboxes/${sbx.sandboxId}/ports/8000/`)]) {
        assert.equal(gone.status, 502)
        assert.deepEqual(await gone.json(), { sandboxId: sbx.sandboxId, message: 'The sandbox was not found', code: 502 })
      }
    })
  },

  // allowPublicTraffic: false: the sandbox's ports need its traffic access
  // token; maskRequestHost sets the Host header the sandbox's server sees.
  async 'traffic-token'() {
    await withSandbox(async (sbx) => {
      assert.ok(sbx.trafficAccessToken)
      await sbx.files.write('/tmp/srv/index.html', 'private')
      await sbx.files.write('/tmp/ws.py', WS_SERVER)
      await sbx.commands.run('cd /tmp/srv && exec python3 -m http.server 8000', { background: true })
      await sbx.commands.run('exec python3 /tmp/ws.py 8001', { background: true })
      const url = `https://${sbx.getHost(8000)}/index.html`
      const withToken = { headers: { 'e2b-traffic-access-token': sbx.trafficAccessToken } }
      const res = await untilStatus(() => fetch(url, withToken))
      assert.equal(res.status, 200)
      assert.equal(await res.text(), 'private')
      const none = await fetch(url)
      assert.equal(none.status, 403)
      assert.match((await none.json()).message, /is missing/)
      const wrong = await fetch(url, { headers: { 'e2b-traffic-access-token': sbx.trafficAccessToken + 'x' } })
      assert.equal(wrong.status, 403)
      assert.match((await wrong.json()).message, /is invalid/)
      const access = await fetch(url, { headers: { 'x-access-token': sbx.envdAccessToken } })
      assert.equal(access.status, 403, 'the envd access token is not the traffic token')
      // The second server may start after the first answered: wait for it too.
      const seen = await (await untilStatus(() => fetch(`https://${sbx.getHost(8001)}/host`, withToken))).text()
      assert.equal(seen, 'masked.example:8001')
    }, { network: { allowPublicTraffic: false, maskRequestHost: 'masked.example:${PORT}' } })
    await withSandbox(async (sbx) => {
      await sbx.files.write('/tmp/srv/index.html', 'public')
      await sbx.commands.run('cd /tmp/srv && exec python3 -m http.server 8000', { background: true })
      const res = await untilStatus(() => fetch(`https://${sbx.getHost(8000)}/`))
      assert.equal(res.status, 200, 'a public sandbox needs no token')
    }, { network: { allowPublicTraffic: true } })
  },

  // Signed URLs on E2B_SANDBOX_URL name no sandbox: the signature does.
  // Expiry is enforced, a tampered URL is refused, and a URL signed for
  // one sandbox opens no other.
  async 'signed-urls-by-signature'() {
    await withSandbox(async (sbx) => {
      await withSandbox(async (other) => {
        await sbx.files.write('/tmp/mine.txt', 'mine')
        await other.files.write('/tmp/mine.txt', 'other')
        const url = await sbx.downloadUrl('/tmp/mine.txt', { useSignatureExpiration: 60 })
        assert.ok(!url.includes(sbx.sandboxId), 'the URL itself names no sandbox')
        const ok = await fetch(url)
        assert.equal(ok.status, 200)
        assert.equal(await ok.text(), 'mine')
        const expired = await fetch(await sbx.downloadUrl('/tmp/mine.txt', { useSignatureExpiration: -10 }))
        assert.equal(expired.status, 401)
        assert.deepEqual(await expired.json(), { code: 401, message: 'signature is already expired' })
        const tampered = new URL(url)
        tampered.searchParams.set('path', '/etc/passwd')
        const bad = await fetch(tampered)
        assert.equal(bad.status, 401)
        assert.deepEqual(await bad.json(), { code: 401, message: 'invalid signature' })
        const aimed = await fetch(url, { headers: { 'E2b-Sandbox-Id': other.sandboxId } })
        assert.equal(aimed.status, 401, 'a URL signed for one sandbox opens no other')
        const up = await sbx.uploadUrl('/tmp/up.txt', { useSignatureExpiration: 60 })
        const form = new FormData()
        form.append('file', new Blob(['uploaded']), 'up.txt')
        const put = await fetch(up, { method: 'POST', body: form })
        assert.equal(put.status, 200, await put.text())
        assert.equal(await sbx.files.read('/tmp/up.txt'), 'uploaded')
        assert.equal(await other.files.exists('/tmp/up.txt'), false)
      })
    })
  },

  // An MCP config makes the SDK start mcp-gateway in the sandbox; where the
  // template has none, create fails as on E2B and the sandbox is killed.
  async 'mcp-failure'() {
    const tag = `mcp-${process.pid}-${Date.now()}`
    await assert.rejects(
      Sandbox.create(TEMPLATE, { timeoutMs: 60_000, metadata: { tag }, mcp: { invalid_server: {} } }),
      (e) => e instanceof SandboxError && /Failed to start MCP gateway/.test(e.message),
    )
    assert.deepEqual(await Sandbox.list({ query: { metadata: { tag }, state: ['running'] } }).nextItems(), [])
  },

  // Template.build (dsec's image builder under E2B's template API): COPY
  // of uploaded files (symbolic links stay links, a dangling one too), RUN as the template's user and
  // as root, ENV taken literally, WORKDIR, and a start command that runs in
  // every new sandbox, which is answered once the ready command succeeds;
  // the template starts by name and by ID, Template.exists finds it, and a
  // failing step fails the build with its output.
  async 'template-build'() {
    const { Template, BuildError, waitForURL } = await import('e2b')
    const fs = await import('node:fs')
    const os = await import('node:os')
    const path = await import('node:path')
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2b-template-test-'))
    try {
      fs.mkdirSync(path.join(dir, 'folder'))
      fs.writeFileSync(path.join(dir, 'folder', 'test.txt'), 'from the context')
      fs.symlinkSync('test.txt', path.join(dir, 'folder', 'link.txt'))
      fs.symlinkSync('nowhere.txt', path.join(dir, 'folder', 'dangling.txt'))
      const name = `dsec-template-${process.pid}-${Date.now()}`
      const template = Template({ fileContextPath: dir })
        .fromBaseImage()
        .copy('folder/*', 'folder', { forceUpload: true })
        .runCmd('cat folder/test.txt > copied.txt')
        .runCmd('whoami > /tmp/ran-as && mkdir -p /srv/www && echo served > /srv/www/index.html', { user: 'root' })
        .setEnvs({ GREETING: 'hi $HOME "quoted"' })
        .setWorkdir('/srv/www')
        .setStartCmd('python3 -m http.server 8000', waitForURL('http://localhost:8000/index.html'))
      const logs = []
      const info = await Template.build(template, name, { onBuildLogs: (l) => logs.push(l.message) })
      assert.match(info.templateId, /^tpl-/)
      assert.ok(logs.some((m) => m.includes('RUN')), `the build's log: ${logs.join('\n')}`)
      assert.equal(await Template.exists(name), true)
      assert.equal(await Template.exists(`${name}-none`), false)
      for (const id of [name, info.templateId]) {
        const sbx = await Sandbox.create(id, { timeoutMs: 120_000 })
        try {
          const r = await sbx.commands.run('cat /home/user/folder/test.txt; echo; cat /home/user/folder/link.txt; echo; readlink /home/user/folder/link.txt /home/user/folder/dangling.txt; cat /home/user/copied.txt; echo; cat /tmp/ran-as; whoami; echo "$GREETING"; pwd; curl -s localhost:8000/index.html')
          assert.equal(r.stdout, 'from the context\nfrom the context\ntest.txt\nnowhere.txt\nfrom the context\nroot\nuser\nhi $HOME "quoted"\n/srv/www\nserved\n')
        } finally {
          await sbx.kill()
        }
      }
      const bad = Template().fromBaseImage().runCmd('echo about to fail; exit 3')
      const e = await rejects(Template.build(bad, `${name}-bad`), BuildError, 'a build whose step fails')
      assert.match(e.message, /exit|status|3/, e.message)
    } finally {
      fs.rmSync(dir, { recursive: true, force: true })
    }
  },

  // The base template is E2B's: commands, file calls and the code
  // interpreter run as "user" (uid 1000, home /home/user, HOME set) in
  // /home/user unless a call names another user or directory; "user" has
  // passwordless sudo; curl, git and python (by that name too) are there.
  async 'base-template'() {
    await withSandbox(async (sbx) => {
      const who = await sbx.commands.run('id -un; id -u; id -Gn; echo "$HOME"; pwd; echo ~')
      assert.equal(who.stdout, 'user\n1000\nuser sudo\n/home/user\n/home/user\n/home/user\n')
      // (Root's commands start in the template's working directory too,
      // as under envd.)
      const root = await sbx.commands.run('id -un; echo "$HOME"; pwd', { user: 'root' })
      assert.equal(root.stdout, 'root\n/root\n/home/user\n')
      const sudo = await sbx.commands.run('sudo -n true && sudo -n id -u && sudo echo "[$FOO]"', { envs: { FOO: 'scoped' } })
      assert.equal(sudo.stdout, '0\n[scoped]\n')
      for (const tool of ['curl --version', 'git --version', 'python --version', 'python3 --version']) {
        const r = await sbx.commands.run(tool)
        assert.equal(r.exitCode, 0, `${tool}: ${r.stderr}`)
      }
      assert.equal((await sbx.commands.run('python -c "import sys; print(sys.version_info[0])"')).stdout, '3\n')
      const git = await sbx.commands.run('git init -q repo && cd repo && git -c user.name=a -c user.email=a@b.c commit -q --allow-empty -m first && git log --format=%s && pwd')
      assert.equal(git.stdout, 'first\n/home/user/repo\n')

      await sbx.files.write('/home/user/mine.txt', 'x')
      const mine = await sbx.files.getInfo('/home/user/mine.txt')
      assert.equal(mine.owner, 'user')
      assert.equal(mine.group, 'user')
      assert.equal((await sbx.files.getInfo('/home/user')).owner, 'user')
      await sbx.files.write('/root/root.txt', 'y', { user: 'root' })
      assert.equal((await sbx.files.getInfo('/root/root.txt', { user: 'root' })).owner, 'root')
      assert.equal(await sbx.files.read('/root/root.txt', { user: 'root' }), 'y')
      await rejects(sbx.files.read('/root/root.txt'), SandboxError, "the default user reads root's home")
      assert.equal((await sbx.commands.run('stat -c %U /home/user/mine.txt /root/root.txt', { user: 'root' })).stdout, 'user\nroot\n')
    })
    const ci = await CodeSandbox.create(CI_TEMPLATE, { timeoutMs: 300_000 })
    try {
      const r = await ci.runCode('import getpass, os\n(getpass.getuser(), os.getcwd(), os.environ["HOME"])')
      assert.equal(r.text, "('user', '/home/user', '/home/user')")
    } finally {
      await ci.kill()
    }
  },

  // Relative paths resolve against the request's user's home directory
  // (from the sandbox's /etc/passwd), as envd resolves them; what a user
  // makes, parents included, is that user's.
  async 'relative-paths'() {
    await withSandbox(async (sbx) => {
      // A user of our own, whatever the image's users are.
      await sbx.commands.run("echo 'tester:x:4321:4321::/home/tester:/bin/sh' >> /etc/passwd && " +
        "echo 'tester:x:4321:' >> /etc/group && mkdir -p /home/tester && chown 4321:4321 /home/tester", { user: 'root' })
      // The default user: commands start in its home, files resolve there.
      const home = (await sbx.commands.run('pwd')).stdout.trim()
      assert.equal(home, (await sbx.commands.run('echo ~')).stdout.trim(), 'a command without cwd starts in the home')
      const w = await sbx.files.write('rel/a.txt', 'alpha')
      assert.equal(w.path, `${home}/rel/a.txt`)
      assert.equal((await sbx.commands.run('cat rel/a.txt')).stdout, 'alpha')
      assert.equal((await sbx.files.getInfo('rel')).path, `${home}/rel`)
      assert.deepEqual((await sbx.files.list('rel')).map((e) => e.path), [`${home}/rel/a.txt`])
      assert.equal((await sbx.files.rename('rel/a.txt', 'rel/b.txt')).path, `${home}/rel/b.txt`)
      assert.equal(await sbx.files.read('rel/b.txt'), 'alpha')
      assert.equal(await sbx.files.exists('rel/a.txt'), false)
      assert.equal((await sbx.commands.run('pwd', { cwd: 'rel' })).stdout, `${home}/rel\n`)
      assert.equal(await sbx.files.makeDir('rel/made'), true)
      assert.equal((await sbx.files.getInfo(`${home}/rel/made`)).type, 'dir')
      await sbx.files.remove('rel')
      assert.equal(await sbx.files.exists(`${home}/rel`), false)

      // Another user: its own home, and what it makes is its own.
      const t = await sbx.files.write('mine.txt', 'x', { user: 'tester' })
      assert.equal(t.path, '/home/tester/mine.txt')
      const info = await sbx.files.getInfo('mine.txt', { user: 'tester' })
      assert.deepEqual([info.path, info.owner, info.group], ['/home/tester/mine.txt', 'tester', 'tester'])
      // (Without cwd a command starts in the image's working directory, if
      // it has one, as envd starts it: the base image's is /home/user.)
      assert.equal((await sbx.commands.run('pwd', { user: 'tester', cwd: '.' })).stdout, '/home/tester\n')
      assert.equal(await sbx.files.makeDir('made/deeper', { user: 'tester' }), true)
      assert.equal((await sbx.commands.run('pwd', { user: 'tester', cwd: 'made' })).stdout, '/home/tester/made\n')
      await sbx.files.makeDir('/tmp/by-tester/a/b', { user: 'tester' })
      await sbx.files.write('/tmp/tester-writes/x/f.txt', 'f', { user: 'tester' })
      for (const p of ['/home/tester/made', '/home/tester/made/deeper', '/tmp/by-tester', '/tmp/by-tester/a', '/tmp/by-tester/a/b',
        '/tmp/tester-writes', '/tmp/tester-writes/x', '/tmp/tester-writes/x/f.txt']) {
        const i = await sbx.files.getInfo(p)
        assert.equal(i.owner, 'tester', `${p} is ${i.owner}'s, want tester's`)
      }
    })
  },

  // remove of a path that is not there succeeds, as envd's (os.RemoveAll).
  async 'remove-missing'() {
    await withSandbox(async (sbx) => {
      await sbx.files.remove('/tmp/never-there')
      await sbx.files.remove('never-there/either')
      await sbx.files.write('/tmp/once.txt', 'x')
      await sbx.files.remove('/tmp/once.txt')
      await sbx.files.remove('/tmp/once.txt')
      assert.equal(await sbx.files.exists('/tmp/once.txt'), false)
    })
  },

  // A symlink is described by what it resolves to: its type and mode, and
  // its absolute path as symlinkTarget; the permissions are the link's own.
  async 'symlink-info'() {
    await withSandbox(async (sbx) => {
      await sbx.files.write('/tmp/ln/target.txt', 'data')
      await sbx.files.makeDir('/tmp/ln/dir')
      await sbx.commands.run('cd /tmp/ln && ln -s target.txt file-link && ln -s /tmp/ln/dir dir-link && ln -s missing dangling && ln -s file-link chain')
      const file = await sbx.files.getInfo('/tmp/ln/file-link')
      assert.deepEqual([file.name, file.path, file.type, file.symlinkTarget, file.permissions, file.mode],
        ['file-link', '/tmp/ln/file-link', 'file', '/tmp/ln/target.txt', 'Lrwxrwxrwx', 0o644])
      assert.equal((await sbx.files.getInfo('/tmp/ln/chain')).symlinkTarget, '/tmp/ln/target.txt', 'a chain resolves to its end')
      const dir = await sbx.files.getInfo('/tmp/ln/dir-link')
      assert.deepEqual([dir.type, dir.symlinkTarget], ['dir', '/tmp/ln/dir'])
      const dangling = await sbx.files.getInfo('/tmp/ln/dangling')
      assert.deepEqual([dangling.type, dangling.symlinkTarget], [undefined, '/tmp/ln/dangling'])
      // A listing: sorted by name, links typed by their targets, the
      // dangling one left out (it has no type the SDK knows).
      const list = await sbx.files.list('/tmp/ln')
      assert.deepEqual(list.map((e) => [e.name, e.type]),
        [['chain', 'file'], ['dir', 'dir'], ['dir-link', 'dir'], ['file-link', 'file'], ['target.txt', 'file']])
      assert.equal(list.find((e) => e.name === 'file-link').symlinkTarget, '/tmp/ln/target.txt')
      assert.equal(list.find((e) => e.name === 'target.txt').symlinkTarget, undefined)
      // Relative, as E2B's own test: the target in the user's home.
      await sbx.files.write('sym-target.txt', 'x')
      await sbx.commands.run('ln -sf sym-target.txt sym-link.txt')
      const home = (await sbx.commands.run('pwd')).stdout.trim()
      assert.equal((await sbx.files.getInfo('sym-link.txt')).symlinkTarget, `${home}/sym-target.txt`)
    })
  },

  // File metadata (envd 0.6.2): user.e2b.* extended attributes, set by an
  // upload (multipart or octet-stream), reported by getInfo, list and
  // rename, replaced by the next upload, and read when set inside.
  async 'file-metadata'() {
    await withSandbox(async (sbx) => {
      const md = { author: 'ada', purpose: 'upload' }
      const w = await sbx.files.write('/tmp/md/a.txt', 'x', { metadata: md })
      assert.deepEqual(w.metadata, md)
      assert.deepEqual((await sbx.files.getInfo('/tmp/md/a.txt')).metadata, md)
      const octet = await sbx.files.write('/tmp/md/b.txt', 'y', { metadata: md, useOctetStream: true })
      assert.deepEqual(octet.metadata, md)
      assert.deepEqual((await sbx.files.getInfo('/tmp/md/b.txt')).metadata, md)
      const many = await sbx.files.writeFiles([{ path: '/tmp/md/m1', data: '1' }, { path: 'md-relative', data: '2' }], { metadata: { source: 'suite' } })
      for (const i of many) {
        assert.deepEqual(i.metadata, { source: 'suite' })
        assert.deepEqual((await sbx.files.getInfo(i.path)).metadata, { source: 'suite' })
      }
      const listed = await sbx.files.list('/tmp/md')
      assert.deepEqual(listed.find((e) => e.name === 'a.txt').metadata, md)
      assert.deepEqual((await sbx.files.rename('/tmp/md/a.txt', '/tmp/md/c.txt')).metadata, md)
      const over = await sbx.files.write('/tmp/md/c.txt', 'overwritten')
      assert.equal(over.metadata, undefined, 'an overwrite without metadata clears it')
      assert.equal((await sbx.files.getInfo('/tmp/md/c.txt')).metadata, undefined)
      const mixed = await sbx.files.write('/tmp/md/d.txt', 'z', { metadata: { Author: 'Ada' } })
      assert.deepEqual(mixed.metadata, { author: 'Ada' }, 'keys are lowercased, as envd does')
      await sbx.commands.run(`python3 -c "import os; os.setxattr('/tmp/md/b.txt', 'user.e2b.stage', b'inside')"`)
      assert.deepEqual((await sbx.files.getInfo('/tmp/md/b.txt')).metadata, { ...md, stage: 'inside' })
      assert.equal((await sbx.files.getInfo('/tmp/md/m1')).metadata.source, 'suite')
    })
  },

  // Watch events carry the entry (envd 0.6.3) when asked; allowNetworkMounts
  // (0.6.4) is accepted and changes nothing for a local directory.
  async 'watch-entry'() {
    await withSandbox(async (sbx) => {
      await sbx.files.makeDir('/tmp/we')
      const events = []
      const w = await sbx.files.watchDir('/tmp/we', (e) => events.push(e), { includeEntry: true })
      await sbx.files.write('/tmp/we/f.txt', 'hello', { metadata: { k: 'v' } })
      // The entry is the file as the watcher finds it when it reports the
      // change: a file removed before then has none. Removed once its write
      // was reported (a slow guest reported it after the removal).
      await until(() => events.some((e) => e.type === 'write' && e.name === 'f.txt'), 30_000)
      await sbx.files.remove('/tmp/we/f.txt')
      await until(() => events.some((e) => e.type === 'remove'), 30_000)
      await w.stop()
      const write = events.find((e) => e.type === 'write' && e.name === 'f.txt' && e.entry)
      assert.ok(write, `no write event with an entry: ${JSON.stringify(events)}`)
      assert.deepEqual([write.entry.name, write.entry.path, write.entry.type], ['f.txt', '/tmp/we/f.txt', 'file'])
      const removed = events.find((e) => e.type === 'remove')
      assert.ok(removed && removed.entry === undefined, `a removal carries no entry: ${JSON.stringify(removed)}`)

      await sbx.files.makeDir('we-rel')
      let seen
      const got = new Promise((resolve) => { seen = resolve })
      const w2 = await sbx.files.watchDir('we-rel', (e) => { if (e.name === 'g.txt') seen(e) }, { allowNetworkMounts: true, includeEntry: true })
      await sbx.files.write('we-rel/g.txt', 'x')
      const e = await Promise.race([got, sleep(10_000)])
      await w2.stop()
      const home = (await sbx.commands.run('pwd')).stdout.trim()
      assert.ok(e && e.entry && e.entry.path === `${home}/we-rel/g.txt`, `event ${JSON.stringify(e)}`)
    })
  },

  // A sandbox killed while a command runs (or a watch is open): the SDK
  // reports that the sandbox was killed or reached its end of life.
  async 'killed-during-run'() {
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000 })
    const cmd = await sbx.commands.run('sleep 60', { background: true })
    let exited
    const watchEnd = new Promise((resolve) => { exited = resolve })
    await sbx.files.watchDir('/tmp', () => {}, { onExit: (err) => exited(err), timeoutMs: 0 })
    await sbx.kill()
    const e = await rejects(cmd.wait(), TimeoutError, 'wait for a command of a killed sandbox')
    assert.ok(e.message.includes('sandbox was killed or reached its end of life'), e.message)
    const we = await Promise.race([watchEnd, sleep(10_000).then(() => 'no end')])
    assert.ok(we instanceof TimeoutError && we.message.includes('sandbox was killed or reached its end of life'), `the watch ended with ${we}`)
  },

  // A paused sandbox stays paused: its envd answers 502 with E2B's body
  // (isRunning is false) and calls fail, until connect resumes it with
  // its files and processes.
  async 'pause-stays-paused'() {
    await withSandbox(async (sbx) => {
      await sbx.files.write('/tmp/kept.txt', 'kept')
      const pid = await backgroundSleep(sbx)
      await sbx.files.write('/tmp/srv/index.html', 'served')
      await sbx.commands.run('cd /tmp/srv && exec python3 -m http.server 8000', { background: true })
      const port = `${process.env.E2B_SANDBOX_URL}/sandboxes/${sbx.sandboxId}/ports/8000/index.html`
      assert.equal(await untilServed(port), 'served')
      assert.equal(await sbx.pause(), true)
      for (let i = 0; i < 3; i++) assert.equal(await sbx.isRunning(), false, 'a request resumed the paused sandbox')
      // A user port too: 502 with the paused body, the sandbox stays paused.
      const viaPort = await fetch(port)
      assert.equal(viaPort.status, 502)
      assert.deepEqual(await viaPort.json(), { sandboxId: sbx.sandboxId, message: 'The sandbox is paused', code: 502, canAutoResume: false })
      const res = await fetch(`${process.env.E2B_SANDBOX_URL}/health`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId } })
      assert.equal(res.status, 502)
      assert.deepEqual(await res.json(), { sandboxId: sbx.sandboxId, message: 'The sandbox is paused', code: 502, canAutoResume: false })
      await rejects(sbx.commands.run('true'), SandboxError, 'commands.run in a paused sandbox')
      await rejects(sbx.files.read('/tmp/kept.txt'), SandboxError, 'files.read in a paused sandbox')
      await rejects(sbx.setTimeout(60_000), SandboxNotFoundError, 'setTimeout of a paused sandbox')
      const info = await sbx.getInfo()
      assert.equal(info.state, 'paused')
      assert.deepEqual(info.lifecycle, { onTimeout: 'kill', autoResume: false })
      const listed = await Sandbox.list({ query: { state: ['paused'] } }).nextItems()
      assert.ok(listed.some((s) => s.sandboxId === sbx.sandboxId))
      await Sandbox.connect(sbx.sandboxId)
      assert.equal(await sbx.isRunning(), true)
      assert.equal((await sbx.getInfo()).state, 'running')
      assert.equal(await sbx.files.read('/tmp/kept.txt'), 'kept')
      assert.equal((await sbx.commands.run(`cat /proc/${pid}/comm`)).stdout.trim(), 'sleep')
      assert.equal(await untilServed(port), 'served')
    })
  },

  // lifecycle onTimeout 'pause': the timeout pauses the sandbox, which
  // only connect resumes, with its state and the timeout connect gives.
  async 'auto-pause'() {
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: PAUSE_TIMEOUT_MS, lifecycle: { onTimeout: 'pause' } })
    try {
      await sbx.files.write('/tmp/kept.txt', 'kept')
      assert.deepEqual((await sbx.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: false })
      await untilState(sbx, 'paused')
      assert.equal(await sbx.isRunning(), false)
      await rejects(sbx.commands.run('true'), SandboxError, 'commands.run after the auto-pause')
      const paused = await sbx.getInfo()
      assert.equal(paused.state, 'paused')
      assert.ok(paused.endAt.getTime() - Date.now() > 3600_000, `a sandbox paused at its timeout ends at ${paused.endAt}`)
      await sbx.connect({ timeoutMs: 300_000 })
      const info = await sbx.getInfo()
      assert.equal(info.state, 'running')
      const left = info.endAt.getTime() - Date.now()
      assert.ok(left > 240_000 && left <= 301_000, `endAt is ${left} ms away after connect, want ~300 s`)
      assert.equal(await sbx.files.read('/tmp/kept.txt'), 'kept')
    } finally {
      await sbx.kill().catch(() => {})
    }
  },

  // lifecycle autoResume: the next request to the paused sandbox (an envd
  // call, /health) resumes it.
  async 'auto-resume'() {
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: PAUSE_TIMEOUT_MS, lifecycle: { onTimeout: 'pause', autoResume: true } })
    try {
      await sbx.files.write('/tmp/kept.txt', 'kept')
      assert.deepEqual((await sbx.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: true })
      await untilState(sbx, 'paused')
      assert.equal((await sbx.commands.run('cat /tmp/kept.txt')).stdout, 'kept')
      await untilState(sbx, 'paused') // its timeout again, from the resume
      assert.equal(await sbx.isRunning(), true, 'a request did not resume the sandbox')
      assert.equal(await sbx.files.read('/tmp/kept.txt'), 'kept')
      // A request to a user port resumes it too.
      await sbx.files.write('/tmp/srv/index.html', 'served')
      await sbx.commands.run('cd /tmp/srv && exec python3 -m http.server 8000', { background: true })
      const port = `${process.env.E2B_SANDBOX_URL}/sandboxes/${sbx.sandboxId}/ports/8000/index.html`
      assert.equal(await untilServed(port), 'served')
      await untilState(sbx, 'paused')
      const res = await fetch(port)
      assert.equal(res.status, 200, 'a request to a user port did not resume the sandbox')
      assert.equal(await res.text(), 'served')
    } finally {
      await sbx.kill().catch(() => {})
    }
  },

  // Snapshots as templates: createSnapshot, listSnapshots (all, by
  // sandbox, by name), sandboxes created from the snapshot's ID, and
  // deleteSnapshot (false for an unknown ID).
  async snapshots() {
    await withSandbox(async (sbx) => {
      await sbx.files.write('/tmp/snap/state.txt', 'at the snapshot')
      const name = `snap-test-${process.pid}-${Date.now()}`
      const snap = await sbx.createSnapshot({ name })
      assert.match(snap.snapshotId, /^snap-/)
      assert.deepEqual(snap.names, [name])
      await sbx.files.write('/tmp/snap/state.txt', 'after the snapshot')
      const ids = async (p) => (await p.nextItems()).map((s) => s.snapshotId)
      try {
        assert.ok((await ids(Sandbox.listSnapshots())).includes(snap.snapshotId))
        assert.deepEqual(await ids(sbx.listSnapshots()), [snap.snapshotId])
        assert.deepEqual(await ids(Sandbox.listSnapshots({ name })), [snap.snapshotId])
        assert.deepEqual(await ids(Sandbox.listSnapshots({ name: `${name}-nope` })), [])
        const children = await Promise.all([0, 1].map(() => Sandbox.create(snap.snapshotId, { timeoutMs: 120_000 })))
        try {
          for (const c of children) {
            assert.equal(await c.files.read('/tmp/snap/state.txt'), 'at the snapshot')
            assert.equal((await c.getInfo()).templateId, snap.snapshotId)
          }
          await children[0].files.write('/tmp/snap/state.txt', 'child 0')
          assert.equal(await children[1].files.read('/tmp/snap/state.txt'), 'at the snapshot')
          assert.equal(await sbx.files.read('/tmp/snap/state.txt'), 'after the snapshot')
        } finally {
          await Promise.all(children.map((c) => c.kill()))
        }
      } finally {
        assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
      }
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
      assert.deepEqual(await ids(Sandbox.listSnapshots({ name })), [])
      assert.equal(await Sandbox.deleteSnapshot('snap-aaaaaaaaaaaaaaaa-local'), false)
      assert.equal(await Sandbox.deleteSnapshot('no-such-template-anywhere'), false)
      await rejects(Sandbox.create(snap.snapshotId), SandboxError, 'create from a deleted snapshot')
    })
  },

  // Sandbox.list is newest first unless asked otherwise, and its pages
  // stay in order when a sandbox goes between them.
  async 'list-order'() {
    const tag = `order-${process.pid}-${Date.now()}`
    const made = []
    for (let i = 0; i < 3; i++) made.push(await Sandbox.create(TEMPLATE, { timeoutMs: 300_000, metadata: { order: tag } }))
    try {
      const query = { metadata: { order: tag } }
      const created = made.map((s) => s.sandboxId)
      const ids = (l) => l.map((s) => s.sandboxId)
      assert.deepEqual(ids(await Sandbox.list({ query }).nextItems()), [...created].reverse())
      assert.deepEqual(ids(await Sandbox.list({ query, order: 'desc' }).nextItems()), [...created].reverse())
      assert.deepEqual(ids(await Sandbox.list({ query, order: 'asc' }).nextItems()), created)
      const pager = Sandbox.list({ query, limit: 1 })
      assert.deepEqual(ids(await pager.nextItems()), [created[2]])
      assert.ok(pager.hasNext)
      await made[1].kill() // the next one in line
      assert.deepEqual(ids(await pager.nextItems()), [created[0]])
      assert.ok(!pager.hasNext)
    } finally {
      await Promise.all(made.map((s) => s.kill()))
    }
  },
}

// WS_SERVER is a small server for the port scenarios: GET /stream writes
// three lines (chunked), the last two once /tmp/stream-go exists (the
// client has the first; after 30 s without it they say "late"), GET /host answers the Host header it
// got, and a WebSocket upgrade answers each text frame with "echo: " and
// the text.
const WS_SERVER = `
import base64, hashlib, http.server, os, struct, sys, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def log_message(self, *a): pass
    def do_GET(self):
        if self.headers.get('Upgrade', '').lower() == 'websocket':
            key = self.headers['Sec-WebSocket-Key'] + '258EAFA5-E914-47DA-95CA-C5AB0DC85B11'
            self.send_response(101)
            self.send_header('Upgrade', 'websocket')
            self.send_header('Connection', 'Upgrade')
            self.send_header('Sec-WebSocket-Accept', base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
            self.end_headers()
            self.wfile.flush()
            while True:
                h = self.rfile.read(2)
                if len(h) < 2 or h[0] & 15 == 8: return
                n = h[1] & 127
                if n == 126: n = struct.unpack('>H', self.rfile.read(2))[0]
                mask = self.rfile.read(4)
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
                out = b'echo: ' + data
                self.wfile.write(bytes([0x81, len(out)]) + out)
                self.wfile.flush()
        body = self.headers.get('Host', '').encode()
        if self.path == '/stream':
            self.send_response(200)
            self.send_header('Transfer-Encoding', 'chunked')
            self.end_headers()
            late = ''
            for i in range(3):
                line = ('tick %d%s\\n' % (i, late)).encode()
                self.wfile.write(b'%x\\r\\n%s\\r\\n' % (len(line), line))
                self.wfile.flush()
                # After the first line: wait for the client to have it.
                for _ in range(600 if i == 0 else 0):
                    if os.path.exists('/tmp/stream-go'): break
                    time.sleep(0.05)
                if i == 0 and not os.path.exists('/tmp/stream-go'): late = ' late'
            self.wfile.write(b'0\\r\\n\\r\\n')
            return
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(('', int(sys.argv[1])), H).serve_forever()
`

// wsEcho sends one WebSocket text frame to port of sbx (by host name over
// TLS, or by path on E2B_SANDBOX_URL) and returns the text of the answer.
async function wsEcho(sbx, port, via, text) {
  const { request } = await import(via === 'host' ? 'node:https' : 'node:http')
  const base = via === 'host' ? `https://${sbx.getHost(port)}/` : `${process.env.E2B_SANDBOX_URL}/sandboxes/${sbx.sandboxId}/ports/${port}/`
  const key = randomBytes(16).toString('base64')
  return await new Promise((resolve, reject) => {
    const req = request(base, { headers: { Connection: 'Upgrade', Upgrade: 'websocket', 'Sec-WebSocket-Key': key, 'Sec-WebSocket-Version': '13' } })
    req.on('response', (res) => reject(new Error(`no upgrade: ${res.statusCode}`)))
    req.on('error', reject)
    req.on('upgrade', (res, socket) => {
      const accept = createHash('sha1').update(key + '258EAFA5-E914-47DA-95CA-C5AB0DC85B11').digest('base64')
      if (res.headers['sec-websocket-accept'] !== accept) return reject(new Error('bad Sec-WebSocket-Accept'))
      const payload = Buffer.from(text)
      const mask = randomBytes(4)
      const frame = Buffer.concat([Buffer.from([0x81, 0x80 | payload.length]), mask, payload.map((b, i) => b ^ mask[i % 4])])
      let got = Buffer.alloc(0)
      socket.on('data', (d) => {
        got = Buffer.concat([got, d])
        if (got.length >= 2 && got.length >= 2 + got[1]) {
          socket.end(Buffer.from([0x88, 0x80, 0, 0, 0, 0]))
          resolve(got.subarray(2, 2 + got[1]).toString())
        }
      })
      socket.on('error', reject)
      socket.write(frame)
    })
    req.end()
  })
}


// How long the lifecycle scenarios' sandboxes live before their timeout
// pauses them (longer for kinds that start slowly).
const PAUSE_TIMEOUT_MS = Number(process.env.PAUSE_TIMEOUT_MS || 3000)

// untilServed GETs url until it answers 200 (a server in the sandbox is
// starting) and returns the body.
async function untilServed(url) {
  for (let i = 0; ; i++) {
    const res = await fetch(url)
    const body = await res.text()
    if (res.status === 200) return body
    if (i >= 100) throw new Error(`${url}: ${res.status} ${body}`)
    await sleep(200)
  }
}

// untilState waits until getInfo reports state.
async function untilState(sbx, state) {
  const deadline = Date.now() + PAUSE_TIMEOUT_MS + 60_000
  for (;;) {
    const got = (await sbx.getInfo()).state
    if (got === state) return
    assert.ok(Date.now() < deadline, `the sandbox is still ${got}, want ${state}`)
    await sleep(250)
  }
}

// backgroundSleep starts `sleep 1000` in the background and returns its
// pid once the sleep itself runs (its login shell forks first).
async function backgroundSleep(sbx) {
  await sbx.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
  const pid = await until(async () => (await sbx.commands.run('pgrep -x sleep || true')).stdout.trim(), 60_000)
  assert.ok(/^\d+$/.test(pid), `the background sleep never started (${pid})`)
  return pid
}

// Volumes: E2B's Volume class (control plane and content API, without a
// sandbox) over dsec's volumes, and volumeMounts at create. The content API
// is at E2B_VOLUME_API_URL (the test sets it to the dsec server). What E2B's
// own volume tests check against a mocked server is checked here against
// dsec.
scenarios.volumes = async function volumes() {
  const { Volume, VolumeError, VolumeFileType, VolumeNotFoundError, VolumePathNotFoundError } = await import('e2b')
  const name = `vol-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 6)}`
  const vol = await Volume.create(name)
  assert.ok(vol.volumeId && vol.token && vol.token !== 'undefined')
  assert.equal(vol.name, name)
  let destroyed = false
  try {
    const info = await Volume.getInfo(vol.volumeId)
    assert.equal(info.volumeId, vol.volumeId)
    assert.equal(info.name, name)
    assert.equal(info.token, vol.token)
    assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId && v.name === name))
    const again = await Volume.connect(vol.volumeId)
    assert.equal(again.token, vol.token)
    await rejects(Volume.getInfo('vol-aaaaaaaaaaaaaaaa-local'), VolumeNotFoundError, 'getInfo of an unknown volume')
    assert.equal(await Volume.destroy('vol-aaaaaaaaaaaaaaaa-local'), false)

    // The content API, without a sandbox.
    const st = await vol.writeFile('/test.txt', 'Hello, World!')
    assert.equal(st.name, 'test.txt')
    assert.equal(st.type, VolumeFileType.FILE)
    assert.equal(st.path, '/test.txt')
    assert.ok(st.mtime instanceof Date && !isNaN(st.mtime))
    assert.equal(await vol.readFile('/test.txt'), 'Hello, World!')
    assert.equal(await vol.readFile('test.txt'), 'Hello, World!', 'a relative path is relative to the root')
    assert.deepEqual(await vol.readFile('/test.txt', { format: 'bytes' }), enc.encode('Hello, World!'))
    assert.equal(await (await vol.readFile('/test.txt', { format: 'blob' })).text(), 'Hello, World!')
    assert.equal(await new Response(await vol.readFile('/test.txt', { format: 'stream' })).text(), 'Hello, World!')
    await vol.writeFile('/binary.bin', new Uint8Array([0, 1, 2, 3, 4]).buffer)
    assert.deepEqual(await vol.readFile('/binary.bin', { format: 'bytes' }), new Uint8Array([0, 1, 2, 3, 4]))
    await vol.writeFile('/stream.txt', new Blob(['from a stream']).stream())
    assert.equal(await vol.readFile('/stream.txt'), 'from a stream')
    await vol.writeFile('/empty.txt', '')
    assert.equal(await vol.readFile('/empty.txt'), '')
    assert.equal((await vol.readFile('/empty.txt', { format: 'bytes' })).length, 0)
    assert.equal((await vol.readFile('/empty.txt', { format: 'blob' })).size, 0)
    assert.equal(await new Response(await vol.readFile('/empty.txt', { format: 'stream' })).text(), '')
    await rejects(vol.writeFile('/test.txt', 'no force'), VolumeError, 'writing over a file without force')
    await rejects(vol.writeFile('/test.txt', 'no force', { force: false }), VolumeError, 'writing over a file with force: false')
    await vol.writeFile('/test.txt', 'New content', { force: true })
    assert.equal(await vol.readFile('/test.txt'), 'New content')
    const meta = await vol.writeFile('/metadata.txt', 'owned', { uid: 1000, gid: 1000, mode: 0o644 })
    assert.deepEqual([meta.uid, meta.gid, meta.mode], [1000, 1000, 0o644])
    await rejects(vol.writeFile('/missing/dir/file.txt', 'x'), VolumePathNotFoundError, 'a write under a missing directory')
    const dir = await vol.makeDir('/nested/deep/path', { force: true })
    assert.equal(dir.type, VolumeFileType.DIRECTORY)
    await vol.writeFile('/nested/deep/path/file.txt', 'Nested file content')
    assert.equal(await vol.readFile('/nested/deep/path/file.txt'), 'Nested file content')
    await rejects(vol.makeDir('/nested'), VolumeError, 'makeDir of an existing directory')
    const dm = await vol.makeDir('/dir-with-metadata', { uid: 1000, gid: 1000, mode: 0o755 })
    assert.deepEqual([dm.uid, dm.gid, dm.mode & 0o777], [1000, 1000, 0o755])
    const fi = await vol.getInfo('/test.txt')
    assert.deepEqual([fi.name, fi.type, fi.path, fi.size], ['test.txt', VolumeFileType.FILE, '/test.txt', 11])
    assert.equal((await vol.getInfo('/nested')).type, VolumeFileType.DIRECTORY)
    assert.equal(await vol.exists('/non-existent.txt'), false)
    assert.equal(await vol.exists('/test.txt'), true)
    const up = await vol.updateMetadata('/test.txt', { uid: 1001, gid: 1001, mode: 0o755 })
    assert.deepEqual([up.path, up.uid, up.gid, up.mode], ['/test.txt', 1001, 1001, 0o755])
    await rejects(vol.updateMetadata('/non-existent.txt', { mode: 0o644 }), VolumePathNotFoundError, 'updateMetadata of a missing path')
    const names = (await vol.list('/')).map((e) => e.name).sort()
    for (const n of ['binary.bin', 'dir-with-metadata', 'empty.txt', 'metadata.txt', 'nested', 'stream.txt', 'test.txt']) {
      assert.ok(names.includes(n), `list / lacks ${n}: ${names}`)
    }
    assert.deepEqual((await vol.list('/nested/deep/path')).map((e) => e.name), ['file.txt'])
    assert.ok((await vol.list('/nested', { depth: 3 })).some((e) => e.path === '/nested/deep/path/file.txt'))
    await rejects(vol.list('/non-existent'), VolumePathNotFoundError, 'list of a missing directory')
    await rejects(vol.readFile('/missing.txt'), VolumePathNotFoundError, 'readFile of a missing file')
    await rejects(vol.readFile('/missing.txt', { format: 'stream' }), VolumePathNotFoundError, 'a streamed readFile of a missing file')
    await vol.remove('/empty.txt')
    assert.equal(await vol.exists('/empty.txt'), false)
    await vol.makeDir('/recursive-dir/nested', { force: true })
    await vol.writeFile('/recursive-dir/nested/file.txt', 'x')
    await vol.remove('/recursive-dir')
    assert.equal(await vol.exists('/recursive-dir'), false)
    await rejects(vol.remove('/non-existent.txt'), VolumePathNotFoundError, 'remove of a missing path')
    const forged = new Volume(vol.volumeId, vol.name, 'not-the-token', vol.domain)
    await rejects(forged.readFile('/test.txt'), AuthenticationError, 'content with a wrong token')

    // Mounted at create: what the content API wrote is there, what the
    // sandbox writes is read back without it, and it outlives the sandbox.
    await withSandbox(async (sbx) => {
      const info = await sbx.getInfo()
      assert.deepEqual(info.volumeMounts, [{ name, path: '/mnt/data' }])
      assert.equal((await sbx.commands.run('cat /mnt/data/nested/deep/path/file.txt')).stdout, 'Nested file content')
      await sbx.commands.run('echo written-in-a-sandbox > /mnt/data/from-sandbox.txt && id -u > /mnt/data/who')
      assert.equal(await vol.readFile('/from-sandbox.txt'), 'written-in-a-sandbox\n')
      const who = (await vol.readFile('/who')).trim()
      assert.equal((await vol.getInfo('/from-sandbox.txt')).uid, Number(who), 'the file is owned by the sandbox user, as the sandbox sees it')
      const e = await rejects(Sandbox.create(TEMPLATE, { timeoutMs: 60_000, volumeMounts: { '/data': vol } }), SandboxError, 'a second sandbox mounting the volume')
      assert.equal(e.statusCode, 409)
      assert.match(e.message, new RegExp(sbx.sandboxId))
      await rejects(Volume.destroy(vol.volumeId), VolumeError, 'destroying a mounted volume')
    }, { volumeMounts: { '/mnt/data': vol } })
    await withSandbox(async (sbx) => {
      assert.equal((await sbx.commands.run('cat /data/from-sandbox.txt')).stdout, 'written-in-a-sandbox\n')
    }, { volumeMounts: { '/data': name } })
    assert.equal(await Volume.destroy(vol.volumeId), true)
    destroyed = true
    assert.equal(await Volume.destroy(vol.volumeId), false)
    await rejects(Volume.getInfo(vol.volumeId), VolumeNotFoundError, 'getInfo of a destroyed volume')
  } finally {
    if (!destroyed) await Volume.destroy(vol.volumeId).catch(() => {})
  }
}

// Kinds that cannot mount volumes refuse volumeMounts with a 400 naming
// the kind.
scenarios['volumes-refused'] = async function volumesRefused() {
  const { Volume } = await import('e2b')
  const vol = await Volume.create(`vol-${Date.now().toString(36)}`)
  try {
    const e = await rejects(Sandbox.create(TEMPLATE, { timeoutMs: 60_000, volumeMounts: { '/data': vol } }), SandboxError, 'volumeMounts on a kind without volumes')
    assert.equal(e.statusCode, 400)
    assert.match(e.message, /cannot mount volumes/)
  } finally {
    await Volume.destroy(vol.volumeId)
  }
}

// A filesystem-only pause (keepMemory: false) ends the sandbox's processes
// and keeps its files; connect() cold-boots it: same ID and token, same
// files, a new boot id, none of the processes from before. The timeout's
// auto-pause does the same.
scenarios['filesystem-pause'] = async function filesystemPause() {
  const bootID = async (sbx) => (await sbx.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout.trim()
  await withSandbox(async (sbx) => {
    await sbx.files.write('/home/user/kept.txt', 'kept')
    await sbx.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
    const pid = await until(async () => (await sbx.commands.run('pgrep -x sleep || true')).stdout.trim(), 60_000)
    assert.ok(/^\d+$/.test(pid), `the background sleep never started (${pid})`)
    const before = await bootID(sbx)
    assert.match(before, /^[0-9a-f-]{36}$/)
    assert.equal(await sbx.pause({ keepMemory: false }), true)
    assert.equal(await sbx.isRunning(), false)
    assert.equal((await sbx.getInfo()).state, 'paused')
    await rejects(sbx.commands.run('true'), SandboxError, 'a command on the paused sandbox')
    const resumed = await sbx.connect()
    assert.equal(resumed.sandboxId, sbx.sandboxId)
    assert.equal(await resumed.files.read('/home/user/kept.txt'), 'kept')
    assert.notEqual(await bootID(resumed), before, 'the boot id after a cold boot')
    assert.equal((await resumed.commands.run('pgrep -x sleep || true')).stdout.trim(), '', 'a process survived the cold boot')
    assert.equal((await resumed.commands.run('whoami')).stdout.trim(), 'user')
  })
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 3_000, lifecycle: { onTimeout: { action: 'pause', keepMemory: false } } })
  try {
    assert.equal((await sbx.getInfo()).lifecycle?.onTimeout, 'pause')
    await sbx.files.write('/home/user/marker.txt', 'marker')
    const before = await bootID(sbx)
    let state = ''
    await until(async () => (state = (await sbx.getInfo()).state) === 'paused', 60_000)
    assert.equal(state, 'paused', 'the sandbox did not pause at its timeout')
    await sbx.connect()
    assert.equal(await sbx.files.read('/home/user/marker.txt'), 'marker')
    assert.notEqual(await bootID(sbx), before, 'the boot id after the auto-pause')
  } finally {
    await sbx.kill().catch(() => {})
  }
}

// Kinds that cannot pause without memory refuse it with a 400 naming the
// kind, at pause() and at create.
scenarios['filesystem-pause-refused'] = async function filesystemPauseRefused() {
  await withSandbox(async (sbx) => {
    const e = await rejects(sbx.pause({ keepMemory: false }), SandboxError, 'a filesystem-only pause')
    assert.match(e.message, /cannot pause without its memory/)
    assert.equal((await sbx.commands.run('echo up')).stdout, 'up\n')
  })
  const e = await rejects(Sandbox.create(TEMPLATE, { lifecycle: { onTimeout: { action: 'pause', keepMemory: false } } }), SandboxError, 'a filesystem-only auto-pause')
  assert.match(e.message, /cannot pause without its memory/)
}

const name = process.argv[2]
if (!scenarios[name]) {
  console.error(`unknown scenario ${name}; have: ${Object.keys(scenarios).join(', ')}`)
  process.exit(2)
}
try {
  await scenarios[name]()
  console.log('ok')
  // Exit now: a failed runCode leaves the SDK's request timer (60 s) armed.
  process.exit(0)
} catch (e) {
  console.error(e?.stack || String(e))
  process.exit(1)
}
