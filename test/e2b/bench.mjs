// Times commands.run(CMD) round trips through the e2b SDK, for
// bench/e2b: prints one JSON array of per-call latencies in microseconds.
// Environment: the E2B_* variables, TEMPLATE, N (calls), WARMUP, CMD.
import { Sandbox } from 'e2b'

const n = Number(process.env.N || 300)
const warmup = Number(process.env.WARMUP || 20)
const cmd = process.env.CMD || 'true'
const sbx = await Sandbox.create(process.env.TEMPLATE || 'base', { timeoutMs: 600_000 })
const lat = []
try {
  for (let i = 0; i < n + warmup; i++) {
    const t0 = process.hrtime.bigint()
    await sbx.commands.run(cmd)
    const us = Number((process.hrtime.bigint() - t0) / 1000n)
    if (i >= warmup) lat.push(us)
  }
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(lat))
process.exit(0)
