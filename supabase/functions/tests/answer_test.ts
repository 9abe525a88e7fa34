// Answers the store cannot hold as given, through the real plane: a lone
// UTF-16 surrogate (a string cut inside an emoji) is journaled losslessly
// and every replay equals the first answer; a raw completion carrying one
// is refused before any request.

import assert from "node:assert/strict";
import { failure, idempotent, PlaneError, success } from "../_shared/idempotency/mod.ts";
import { hashOf, Lossy, organization, plane, uniqueKey } from "./support.ts";

const SCOPE = "tool.email.send";
/** "😀".slice(0, 1): the high half of a surrogate pair, alone. */
const CUT = "😀".slice(0, 1);

Deno.test("an answer holding a lone surrogate is journaled and replayed equal, in values, keys and errors", async () => {
  assert.equal(CUT.isWellFormed(), false);
  const p = plane();
  const org = organization();
  const answers = [
    success({ preview: `Hello ${CUT}`, tags: [CUT, "ok"] }),
    success({ [`key-${CUT}`]: 1 }),
    failure(`declined ${CUT}`, { at: CUT }),
  ];
  for (const answer of answers) {
    let runs = 0;
    const options = {
      plane: p,
      organizationId: org,
      scope: SCOPE,
      key: uniqueKey(),
      request: { n: 1 },
      timeoutMs: 2_000,
    };
    const first = await idempotent(() => {
      runs += 1;
      return answer;
    }, options);
    assert.equal(first.status, "ran", JSON.stringify(first));
    if (first.status !== "ran") return;
    assert.equal(first.settled.ending, "journaled", JSON.stringify(first.settled));
    const replay = await idempotent(() => {
      runs += 1;
      return success("never");
    }, options);
    assert.equal(replay.status, "replayed");
    if (replay.status !== "replayed") return;
    assert.equal(runs, 1, "the effect ran once");
    assert.deepEqual(replay.answer, first.answer);
    assert.deepEqual(replay.answer.output, answer.output, "read back as itself, lone surrogate and all");
    assert.equal(replay.answer.error, answer.error);
  }
});

Deno.test("a raw completion holding a lone surrogate is refused before any request", async () => {
  const lossy = new Lossy();
  const p = plane({ fetch: lossy.fetch });
  const claimed = await p.claim({
    organizationId: organization(),
    scope: SCOPE,
    key: uniqueKey(),
    requestHash: await hashOf(1),
    leaseMs: 30_000,
  });
  if (claimed.outcome !== "claimed") throw new Error(claimed.outcome);
  await assert.rejects(p.complete(claimed.claim, { response: { text: CUT } }), (error: unknown) => {
    assert.ok(error instanceof PlaneError && error.reason === "unstorable_response", String(error));
    assert.ok(error.message.includes("lone_surrogate"), error.message);
    return true;
  });
  await assert.rejects(
    p.complete(claimed.claim, { resource: { resourceType: "email", resourceId: `m-${CUT}` } }),
    (error: unknown) => error instanceof PlaneError && error.kind === "invalid_input",
  );
  assert.equal(lossy.count("idempotency_complete"), 0, "nothing was sent");
  assert.equal(await p.release(claimed.claim), "recorded");
});
