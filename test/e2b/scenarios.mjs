// Scenarios that drive dsec with the unmodified e2b and
// @e2b/code-interpreter SDKs; e2b_test.go runs each one as
// `node scenarios.mjs <name>` against a dsec it started. A scenario throws
// (and the process exits 1) when dsec does not behave as E2B does.
//
// Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (the dsec server),
// TEMPLATE and CI_TEMPLATE (the templates to create, which select the kind),
// COUNT (concurrent-creates).
import assert from 'node:assert/strict'
import {
  Sandbox, AuthenticationError, CommandExitError, FileNotFoundError, NotFoundError,
  SandboxError, SandboxNotFoundError, TimeoutError,
} from 'e2b'
import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'

const TEMPLATE = process.env.TEMPLATE || 'base'
const CI_TEMPLATE = process.env.CI_TEMPLATE || 'code-interpreter-v1'
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
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
      assert.equal(info.envdVersion, '0.5.7')
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
      const events = []
      const t0 = Date.now()
      const r = await sbx.commands.run('echo one; sleep 0.4; echo two >&2; sleep 0.4; echo three', {
        onStdout: (d) => events.push(['out', d, Date.now() - t0]),
        onStderr: (d) => events.push(['err', d, Date.now() - t0]),
      })
      assert.equal(r.exitCode, 0)
      assert.equal(r.stdout, 'one\nthree\n')
      assert.equal(r.stderr, 'two\n')
      assert.deepEqual(events.map((e) => e.slice(0, 2)), [['out', 'one\n'], ['err', 'two\n'], ['out', 'three\n']])
      // Streamed, not delivered at the end: "one" arrived well before "three".
      assert.ok(events[2][2] - events[0][2] >= 300, `output was not streamed: ${JSON.stringify(events)}`)
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
      await sleep(300)
      const left = await sbx.commands.run('pgrep -c -x sleep || true')
      assert.equal(left.stdout.trim(), '0', 'the timed-out command is still running')
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
      await rejects(sbx.files.remove('/tmp/missing'), FileNotFoundError, 'remove of a missing file')
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
      for (let i = 0; i < 50 && !want.every((x) => events.includes(x)); i++) await sleep(100)
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
      for (let i = 0; i < 100 && await sbx.isRunning(); i++) await sleep(100)
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
      let pid = ''
      for (let i = 0; i < 200 && !pid; i++) {
        pid = (await sbx.commands.run('pgrep -x sleep || true')).stdout.trim()
        if (!pid) await sleep(50)
      }
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
      const times = []
      await sbx.runCode('import time\nprint("a")\ntime.sleep(0.8)\nprint("b")', { onStdout: () => times.push(Date.now()) })
      assert.equal(times.length, 2)
      assert.ok(times[1] - times[0] >= 300, 'runCode output must stream as it is printed')
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
    await rejects(Sandbox.create(TEMPLATE, { lifecycle: { onTimeout: 'pause' } }), SandboxError, 'an unsupported lifecycle')
    await withSandbox(async (sbx) => {
      const real = sbx.envdAccessToken
      sbx.envdAccessToken = 'wrong-token'
      await rejects(sbx.commands.run('true'), AuthenticationError, 'commands.run with a wrong access token')
      await rejects(sbx.files.exists('/tmp'), AuthenticationError, 'files.exists with a wrong access token')
      sbx.envdAccessToken = real
      assert.equal((await sbx.commands.run('echo ok')).stdout, 'ok\n')
      await rejects(sbx.files.watchDir('/tmp', () => {}, { includeEntry: true }), Error, 'includeEntry needs envd 0.6.3')
      // A sandbox created without internet access has no network whose
      // rules could change (rules at create and at runtime: wire_test.go).
      const e = await rejects(sbx.updateNetwork({ allowOut: ['example.com'] }), SandboxError, 'updateNetwork without internet access')
      assert.equal(e.statusCode, 400)
    })
  },
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
