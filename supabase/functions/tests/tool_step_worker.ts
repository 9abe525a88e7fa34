// One orchestrator step as a process of its own, for tool_test.ts to kill:
// it guards one tool call that POSTs to the simulated vendor at VENDOR_URL,
// prints `vendor answered` once the vendor has applied it, and then hangs
// before its answer can be journaled, as a worker stopped at its wall-clock
// limit does. REPEAT is `vendor_key` (the vendor dedupes on the key) or
// `reconcile` (the vendor takes none; the tool sends a reference instead).

import { RetryHorizon, success, ToolGuard, toolKey, toolSpec } from "../_shared/idempotency/mod.ts";
import { plane } from "./support.ts";

const env = (name: string) => {
  const value = Deno.env.get(name);
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const repeat = env("REPEAT") === "reconcile" ? { reconcile: () => Promise.resolve(undefined) } : "vendor_key";
const spec = toolSpec("tool.email.send", Number(env("TIMEOUT_MS")), repeat);
// The key from the Run and the step, as the orchestrator's replay derives it again.
const key = toolKey(env("RUN_ID"), env("STEP_ID"));
const guard = new ToolGuard(plane(), {
  horizon: RetryHorizon.untilLastAttempt(60_000),
  journalDeadlineMs: 1_000,
  leaseMarginMs: 1_000,
});
await guard.run({
  organizationId: env("ORGANIZATION_ID"),
  spec,
  key,
  arguments: JSON.parse(env("ARGUMENTS")),
  tool: async (call) => {
    const headers: Record<string, string> = { "content-type": "application/json" };
    if (repeat === "vendor_key") headers["idempotency-key"] = call.vendorKey;
    const response = await fetch(env("VENDOR_URL"), {
      method: "POST",
      headers,
      body: JSON.stringify({ reference: key, to: "a@example.com" }),
    });
    const sent = await response.json();
    console.log("vendor answered");
    await new Promise(() => setInterval(() => {}, 1_000)); // Stopped here, before the journal.
    return success(sent);
  },
});
