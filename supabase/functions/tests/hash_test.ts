// The request hash against the vectors the Rust crate is tested with.

import assert from "node:assert/strict";
import { canonicalize, isRequestHash, PlaneError, requestHash } from "../_shared/idempotency/mod.ts";

const vectorsUrl = new URL("../../../tests/vectors/request_hash.json", import.meta.url);
const vectors: Array<{ input: unknown; canonical: string; sha256: string }> = JSON.parse(
  await Deno.readTextFile(vectorsUrl),
);

Deno.test("every shared vector canonicalizes and hashes as the Rust crate does", async () => {
  assert.ok(vectors.length >= 25, `only ${vectors.length} vectors`);
  for (const vector of vectors) {
    assert.equal(canonicalize(vector.input), vector.canonical, JSON.stringify(vector.input));
    assert.equal(await requestHash(vector.input), vector.sha256, vector.canonical);
    assert.ok(isRequestHash(vector.sha256));
  }
});

Deno.test("what has no JSON form is refused as invalid input", () => {
  for (const value of [NaN, Infinity, 1n, () => 1, { a: Symbol("s") }, "\ud800"]) {
    assert.throws(() => canonicalize(value), (error: unknown) => {
      assert.ok(error instanceof PlaneError);
      assert.equal(error.kind, "invalid_input");
      assert.equal(error.reason, "unhashable_request");
      return true;
    });
  }
});

Deno.test("undefined members are left out and toJSON is honoured, as JSON.stringify does", () => {
  assert.equal(canonicalize({ b: undefined, a: [undefined, 1] }), '{"a":[null,1]}');
  assert.equal(canonicalize({ at: new Date(0) }), '{"at":"1970-01-01T00:00:00.000Z"}');
  assert.ok(!isRequestHash("A".repeat(64)));
});
