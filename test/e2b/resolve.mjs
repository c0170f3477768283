import dns from 'node:dns'
const map = (process.env.DSEC_TEST_RESOLVE || '').split(',').filter(Boolean).map((e) => e.split('='))
const orig = dns.lookup
function target(host) {
  host = String(host).toLowerCase().replace(/\.$/, '')
  for (const [d, ip] of map) if (host === d || host.endsWith('.' + d)) return ip
}
dns.lookup = function (host, opts, cb) {
  const ip = target(host)
  if (!ip) return orig.apply(this, arguments)
  if (typeof opts === 'function') { cb = opts; opts = {} }
  if (typeof opts === 'number') opts = { family: opts }
  const family = ip.includes(':') ? 6 : 4
  process.nextTick(() => opts?.all ? cb(null, [{ address: ip, family }]) : cb(null, ip, family))
}
