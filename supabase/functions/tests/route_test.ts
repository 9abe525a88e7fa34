// The scheduled routes' door and the re-drive route's checks, without a
// plane: who may call (the route secret or the service key, as a bearer
// token or as apikey, in constant time), and what a body may ask.

import assert from "node:assert/strict";
import { callerAuthorized, redriveRoute, routeCredentials } from "../_shared/idempotency/mod.ts";

const SECRET = "route-secret-0123456789abcdefghijklmnop";
const SERVICE = "sb_secret_service0123";

function post(headers: Record<string, string>, body?: string): Request {
  return new Request("http://fn.local/redrive", { method: "POST", headers, body });
}

function route(calls: number[]) {
  return redriveRoute({
    credentials: [SECRET, SERVICE],
    scope: "webhook.standard",
    maxLimit: 1000,
    redrive: (limit) => {
      calls.push(limit);
      return Promise.resolve({ redriven: 1, journaled: 1, deadLettered: 0, left: 0 });
    },
  });
}

Deno.test("the route secret and the service key are read from the environment; a short secret is refused", () => {
  const env = (vars: Record<string, string>) => (name: string) => vars[name];
  assert.deepEqual(
    routeCredentials(env({ IDEM_ROUTE_SECRET: SECRET, SUPABASE_SECRET_KEYS: `{"default":"${SERVICE}"}` })),
    [SECRET, SERVICE],
  );
  assert.deepEqual(routeCredentials(env({ SUPABASE_SERVICE_ROLE_KEY: "a.b.c" })), ["a.b.c"]);
  // Every key the environment holds, whichever the plane uses: an operator's
  // idem redrive --to may send the legacy JWT or another named secret key.
  assert.deepEqual(
    routeCredentials(env({
      SUPABASE_SECRET_KEYS: '{"default":"sb_secret_a","workers":"sb_secret_b","web":"sb_publishable_c"}',
      SUPABASE_SERVICE_ROLE_KEY: "a.b.c",
    })),
    ["sb_secret_a", "sb_secret_b", "a.b.c"],
  );
  assert.deepEqual(routeCredentials(env({ SUPABASE_SECRET_KEYS: "not json", SUPABASE_SERVICE_ROLE_KEY: "a.b.c" })), [
    "a.b.c",
  ]);
  assert.deepEqual(routeCredentials(env({})), []);
  assert.throws(() => routeCredentials(env({ IDEM_ROUTE_SECRET: "short" })), /at least 32 characters/);
});

Deno.test("a caller is let in by a credential as a bearer token or as apikey, and by nothing else", () => {
  const credentials = [SECRET, SERVICE];
  assert.ok(callerAuthorized(post({ authorization: `Bearer ${SECRET}` }), credentials));
  assert.ok(callerAuthorized(post({ authorization: `bearer ${SERVICE}` }), credentials));
  assert.ok(callerAuthorized(post({ apikey: SERVICE }), credentials));
  for (
    const headers of <Record<string, string>[]> [
      {},
      { authorization: SECRET },
      { authorization: `Bearer ${SECRET}x` },
      { authorization: `Bearer ${SECRET.slice(0, -1)}` },
      { apikey: "sb_secret_other" },
      { authorization: "Bearer " },
    ]
  ) {
    assert.ok(!callerAuthorized(post(headers), credentials), JSON.stringify(headers));
  }
  assert.ok(!callerAuthorized(post({ authorization: "Bearer " }), [""]), "an empty credential lets nobody in");
  assert.ok(!callerAuthorized(post({ apikey: SERVICE }), []), "no credential: nobody");
});

Deno.test("the re-drive route runs one pass for an authorized, well-formed ask and refuses the rest", async () => {
  const calls: number[] = [];
  const handle = route(calls);
  const ok = await handle(post({ authorization: `Bearer ${SECRET}` }, '{"limit": 7, "scope": "webhook.standard"}'));
  assert.equal(ok.status, 200);
  assert.deepEqual(await ok.json(), { redriven: 1, journaled: 1, dead_lettered: 0, left: 0 });
  assert.equal((await handle(post({ apikey: SERVICE }))).status, 200, "no body: the default limit");
  assert.deepEqual(calls, [7, 50]);

  const refusals: [Request, number, RegExp][] = [
    [post({}, '{"limit": 1}'), 401, /route secret or the service key/],
    [post({ authorization: "Bearer guess" }), 401, /route secret/],
    [post({ apikey: SERVICE }, "not json"), 400, /must be JSON/],
    [post({ apikey: SERVICE }, "[1]"), 400, /JSON object/],
    [post({ apikey: SERVICE }, '{"limit": 0}'), 400, /from 1 to 1000/],
    [post({ apikey: SERVICE }, '{"limit": 1001}'), 400, /from 1 to 1000/],
    [post({ apikey: SERVICE }, '{"limit": 1.5}'), 400, /from 1 to 1000/],
    [post({ apikey: SERVICE }, '{"limit": "5"}'), 400, /from 1 to 1000/],
    [post({ apikey: SERVICE }, '{"scope": "webhook.other"}'), 400, /webhook.standard only/],
    [post({ apikey: SERVICE }, JSON.stringify({ limit: 1, pad: "x".repeat(5000) })), 413, /larger than 4096/],
    [new Request("http://fn.local/redrive", { method: "GET", headers: { apikey: SERVICE } }), 405, /POST only/],
  ];
  for (const [request, status, message] of refusals) {
    const answer = await handle(request);
    assert.equal(answer.status, status, `${request.method} ${status}`);
    assert.match((await answer.json()).error, message);
  }
  assert.deepEqual(calls, [7, 50], "no refused ask ran a pass");
});
