// The Idempotency-Key middleware's parts, none of which needs a plane: the
// fingerprint and the scope (fingerprint.ts), the key (key.ts), the stored
// form (stored_response.ts), and the options refused when the middleware is
// made (http.ts). The middleware against a plane is http_test.ts.
//
//   cd supabase/functions && deno test tests/http_parts_test.ts

import {
  fingerprint,
  idempotencyKey,
  IdempotencyPlane,
  planeKey,
  scopeOf,
  silent,
  withIdempotencyKey,
} from "../_shared/idempotency/mod.ts";
import type { IdempotencyKeyOptions } from "../_shared/idempotency/http.ts";
import { exactNumber } from "../_shared/idempotency/fingerprint.ts";
import { replay, storedOf } from "../_shared/idempotency/stored_response.ts";
import { assert, assertEquals, assertRejects } from "./assert.ts";

const JSON_HEADERS = new Headers({ "content-type": "application/json; charset=utf-8" });

function post(body: string, headers = JSON_HEADERS, target = "/o"): Promise<string> {
  return fingerprint("POST", target, headers, new TextEncoder().encode(body));
}

Deno.test("fingerprint: the Rust layer's pinned hashes, byte for byte", async () => {
  // src/callers/idempotency_key/fingerprint.rs,
  // the_fingerprint_is_pinned_whatever_serde_json_keeps_of_numbers.
  const pinned: [string, string][] = [
    ['{"b":[1,2.50,1e2],"a":"x"}', "cae471138847311575707981c346025d5662427a7caac27c62552415b2e7fded"],
    ['{"amount":9007199254740993.0}', "99e660e025e502b00271861de965b4dc8c7a9ca370a382cfa0c0c4268e11abcd"],
    ['{"amount":123456789012345678901234567890}', "89af46f63d0a03bc9a1d361314074dc034aace01c63de820313bf760827c48ad"],
    ['{"rate":1e400}', "a4cbb70b4d44ca926e6dfd9f549d010aebddc6d44455323a8eef4aa55af5ea83"],
    ['{"a":1,"a":2}', "8c69134763ff553f4acf0d4f5c2443668dc5e69336f92c35a4c69690fa8fff05"],
  ];
  for (const [body, hash] of pinned) assertEquals(await post(body), hash, body);
  assertEquals(await post('{"a":"x","b":[1,2.5,100]}'), pinned[0][1], "by its value");
});

Deno.test("fingerprint: numbers count by value only when the canonical form writes them exactly", async () => {
  const same = [
    ["[100]", "[1e2]"],
    ["[100]", "[1E+2]"],
    ["[0.1]", "[0.10]"],
    ["[0.1]", "[1e-1]"],
    ["[0]", "[0.0]"],
    ["[1.5e-7]", "[0.00000015]"],
    ["[1e21]", "[1000000000000000000000]"],
    ["[123456789012]", "[1.23456789012e11]"],
    ['{"a":1,"b":[1,2]}', '{ "b": [1,2], "a": 1.0 }'],
  ];
  for (const [a, b] of same) assertEquals(await post(a), await post(b), `${a} and ${b}`);
  const different = [
    ["[9007199254740993]", "[9007199254740992]"],
    ["[9007199254740993.0]", "[9007199254740992.0]"],
    ["[9007199254740993e0]", "[9007199254740992e0]"],
    ["[90071992547409930e-1]", "[9007199254740992]"],
    ["[0.1000000000000000000001]", "[0.1]"],
    ["[0.30000000000000004441]", "[0.30000000000000004]"],
    ["[1e-400]", "[0]"],
    ["[-0]", "[0]"],
    ["[-0.0]", "[0]"],
    ["[1e400]", "[1e401]"],
    ["[18446744073709551616]", "[18446744073709552000]"],
    ['{"a":1,"a":2}', '{"a":2}'],
    ['{"a":1,"\\u0061":2}', '{"a":2}'],
    ['[{"x":{"a":1,"a":1}}]', '[{"x":{"a":1}}]'],
    ['{"a":"\\ud800"}', '{ "a":"\\ud800"}'],
    ["[" + "[".repeat(127) + "]".repeat(127) + "]", " [" + "[".repeat(127) + "]".repeat(127) + "]"],
    ['\ufeff{"a":1}', '{"a":1}'],
  ];
  for (const [a, b] of different) assert(await post(a) !== await post(b), `${a} and ${b} are two requests`);
  // 127 levels are read by value (serde_json's limit is 128).
  const deep = "[".repeat(127) + "]".repeat(127);
  assertEquals(await post(deep), await post(` ${deep} `), "127 levels");
  assertEquals(
    await post('{"a":{"a":"a"},"b":[{"a":1},{"a":1}]}'),
    await post('{"b":[{"a":1},{"a":1}],"a":{"a":"a"}}'),
  );
  assert(exactNumber("0.1") && exactNumber("9007199254740992") && exactNumber("5e-324"));
  assert(!exactNumber("9007199254740993") && !exactNumber("4e-324") && !exactNumber("-0"));
  assert(!exactNumber("1e99999999999999999999"), "an exponent beyond i64");
});

Deno.test("fingerprint: content type, target and counted headers are part of the request", async () => {
  const typed = (type: string) => post('{"a":1}', new Headers({ "content-type": type }));
  const json = await typed("application/json");
  assert(json !== await typed("application/vnd.api+json"));
  assert(json !== await typed("text/plain"));
  assert(json !== await post('{"a":1}', new Headers()), "no content type");
  assertEquals(await typed("application/json"), json);
  // Not declared JSON: bytes.
  assert(await post('{"a":1}', new Headers()) !== await post('{ "a": 1 }', new Headers()));
  assert(await post("{}", JSON_HEADERS, "/accounts/1") !== await post("{}", JSON_HEADERS, "/accounts/2"));
  assert(await post("{}", JSON_HEADERS, "/a") !== await post("{}", JSON_HEADERS, "/a?currency=EUR"));
  const counted = (currency: string, id: string) =>
    fingerprint(
      "POST",
      "/o",
      new Headers({ "content-type": "application/json", "x-currency": currency, "x-request-id": id }),
      new TextEncoder().encode("{}"),
      ["X-Currency"],
    );
  assert(await counted("EUR", "1") !== await counted("USD", "2"));
  assertEquals(await counted("EUR", "1"), await counted("EUR", "3"));
  assert(await fingerprint("PATCH", "/o", JSON_HEADERS, new Uint8Array()) !== await post(""));
});

Deno.test("scope: routes become the Rust layer's scopes, long ones hashed within the limit", async () => {
  assertEquals(await scopeOf("POST", "/orders"), "http.post.orders");
  assertEquals(await scopeOf("PATCH", "/orders/{id}/Items"), "http.patch.orders.id.items");
  assertEquals(await scopeOf("POST", "/"), "http.post.root");
  assertEquals(await scopeOf("POST", "/v1/café"), "http.post.v1.caf_");
  assertEquals(await scopeOf("FROB!", "/orders"), "http.frob_.orders");
  const base = `/v1/${"segment/".repeat(20)}`;
  const routes = [`${base}{id}/a`, `${base}{id}/b`, `${base}{id}:b`, base];
  const scopes = await Promise.all(routes.map((route) => scopeOf("POST", route)));
  for (const scope of scopes) {
    assertEquals(scope.length, 128);
    assert(scope.startsWith("http.post.v1.segment.segment.") && /^[a-z0-9._-]+$/.test(scope), scope);
  }
  assertEquals(new Set(scopes).size, routes.length);
  const atLimit = `/${"x".repeat(128 - "http.post.".length)}`;
  assertEquals(await scopeOf("POST", atLimit), `http.post.${atLimit.slice(1)}`);
  assertEquals((await scopeOf("POST", `${atLimit}y`)).length, 128);
});

Deno.test("keys: bare or quoted are read, bad ones refused; a caller's key is its own", async () => {
  const read = (value: string | null) =>
    idempotencyKey(new Headers(value === null ? {} : { "idempotency-key": value }));
  assertEquals(read(null), undefined);
  assertEquals(read("abc-1"), { key: "abc-1" });
  assertEquals(read('"8e03978e-40d5"'), { key: "8e03978e-40d5" });
  assertEquals(read('"'), { key: '"' });
  for (const bad of ["", '""', "   ", '"a"b"', "caf\u00c3\u00a9", "k".repeat(256), '"one", "two"']) {
    const refused = read(bad);
    assert(refused !== undefined && "problem" in refused, `${JSON.stringify(bad)} was accepted`);
    assertEquals([refused.problem.status, refused.problem.slug], [400, "malformed-key"]);
  }
  assertEquals(read("k".repeat(255)), { key: "k".repeat(255) });
  assertEquals(await planeKey("k-1", undefined), "k-1");
  const alice = await planeKey("k-1", "alice");
  assert(alice !== await planeKey("k-1", "bob") && alice !== await planeKey("k-2", "alice"));
  assert(alice.endsWith("\u00a7k-1") && !alice.includes("alice") && alice.length === 64 + 1 + 3, alice);
});

Deno.test("stored form: text and binary bodies replay byte for byte with the kept headers only", async () => {
  const headers = new Headers({ "content-type": "application/json", location: "/orders/1", "set-cookie": "s=1" });
  for (const body of [new TextEncoder().encode('{"id":1}'), new Uint8Array([0xff, 0x00, 0xfe]), new Uint8Array()]) {
    const stored = storedOf(201, headers, ["content-type", "location", "set-cookie"], body);
    assertEquals(stored.headers, [["content-type", "application/json"], ["location", "/orders/1"]]);
    const back = replay(JSON.parse(JSON.stringify(stored)))!;
    assertEquals(back.status, 201);
    assertEquals(back.headers.get("idempotent-replayed"), "true");
    assertEquals(back.headers.get("set-cookie"), null);
    assertEquals([...new Uint8Array(await back.arrayBuffer())], [...body]);
  }
  assertEquals(storedOf(200, new Headers(), [], new Uint8Array([0x61, 0]))?.body_base64, "YQA=");
  assertEquals(replay({ status: 1000, headers: [] }), undefined);
  assertEquals(replay({ status: 200, headers: [], body_text: "a", body_base64: "YQ==" }), undefined);
  assertEquals(replay({ status: 200, headers: [], body_base64: "YR==" }), undefined, "stray bits");
  assertEquals(replay({ status: 200, headers: [["bad name", "x"]] }), undefined);
  assertEquals(replay({ ok: true }), undefined);
  const held = replay({ status: 200, headers: [["Set-Cookie", "s"], ["WWW-Authenticate", "x"], ["x-trace", "1"]] })!;
  assertEquals([...held.headers.keys()], ["idempotent-replayed", "x-trace"]);
});

Deno.test("configuration: credential headers, both scopings and a bad timing are refused when made", async () => {
  const plane = IdempotencyPlane.connect({ url: "http://127.0.0.1:1", key: "k" });
  const base: IdempotencyKeyOptions = { plane, organizationId: crypto.randomUUID(), route: "/o", log: silent };
  const ok = () => new Response("x");
  for (const name of ["Set-Cookie", "authorization", "Proxy-Authorization", "cookie", "www-authenticate", "apikey"]) {
    await assertRejects(() => withIdempotencyKey(ok, { ...base, keepHeaders: [name] }), /carries credentials/);
  }
  withIdempotencyKey(ok, { ...base, keepHeaders: ["x-request-cost"] });
  await assertRejects(
    () => withIdempotencyKey(ok, { ...base, principal: () => "a", sharedAcrossCallers: true }),
    /not both/,
  );
  await assertRejects(() => withIdempotencyKey(ok, { ...base, handlerTimeoutMs: 0 }), /above zero/);
  await assertRejects(() => withIdempotencyKey(ok, { ...base, journalDeadlineMs: 24 * 3600 * 1000 }), /longer/);
});
