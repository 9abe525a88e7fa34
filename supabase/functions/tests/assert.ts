// Assertions the Idempotency-Key tests share (http_parts_test.ts,
// http_test.ts). Needs no plane, so the tests of the parts can import it.

import nodeAssert from "node:assert/strict";

/** Fails with `message` unless `condition` holds. */
export function assert(condition: unknown, message = "assertion failed"): asserts condition {
  if (!condition) throw new Error(message);
}

/** Strict deep equality: `undefined` is not `null`, and types count. */
export function assertEquals(actual: unknown, expected: unknown, message = ""): void {
  nodeAssert.deepStrictEqual(actual, expected, message || undefined);
}

/** Runs `run` and fails unless it throws something whose text matches `pattern`. */
export async function assertRejects(run: () => unknown, pattern: RegExp): Promise<void> {
  try {
    await run();
  } catch (error) {
    assert(pattern.test(String(error)), `${error} does not match ${pattern}`);
    return;
  }
  throw new Error(`expected a throw matching ${pattern}`);
}
