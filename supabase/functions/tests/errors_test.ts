// The retry classification, against the file both clients read: what a
// repeat-safe call and any call may retry, and what is transient.

import assert from "node:assert/strict";
import { PlaneError } from "../_shared/idempotency/mod.ts";
import policy from "../_shared/idempotency/rpc_policy.json" with { type: "json" };

function answered(status: number, code: string): PlaneError {
  return new PlaneError("api", `${status} ${code}`, { fn: "idempotency_release", status, code });
}

Deno.test("an answer that proves the call never ran is retried even when unsafe to repeat", () => {
  for (const entry of policy.never_ran) {
    const error = answered(entry.status, entry.code);
    assert.ok(error.isRetryable(false) && error.neverReachedThePlane, `${entry.status} ${entry.code}`);
  }
});

Deno.test("a lost database connection may have run the call: retried only when safe, and transient", () => {
  assert.ok(policy.connection_lost.length > 0);
  for (const entry of policy.connection_lost) {
    const error = answered(entry.status, entry.code);
    assert.equal(error.isRetryable(false), false, "a release that may have happened is not sent again");
    assert.equal(error.isRetryable(true), true, "a repeat-safe call is");
    assert.equal(error.isTransient, true, "a later try may succeed");
    assert.equal(error.neverReachedThePlane, false, "it may have run");
  }
  // Any other 500 is not retried.
  assert.equal(answered(500, "XX000").isRetryable(true), false);
});
