// The clock every deadline and elapsed time of this client is measured on.
//
// A wall clock (`Date.now()`) steps: NTP corrects it, an operator sets it, a
// VM resumes with it far behind or ahead. A deadline measured on it stretches
// or shrinks by the step: stepped back an hour, an effect past its timeout
// would be waited for an hour, past its lease, while a reclaimer runs it
// too; stepped forward, a journal would give up at once and leave its claim
// to its lease. `performance.now()` never steps (Deno, Node.js, Cloudflare
// Workers): it only moves forward, at the rate time passes.

/**
 * Milliseconds on a monotonic clock (`performance.now()`). Its origin is
 * arbitrary (the process's start), so only differences and deadlines
 * computed from it mean anything: never compare it with `Date.now()` or a
 * database timestamp.
 */
export function monotonicNow(): number {
  return performance.now();
}
