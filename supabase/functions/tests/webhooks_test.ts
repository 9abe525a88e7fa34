// The example webhook function (webhooks/index.ts) as a process of its own,
// against the local plane: Standard Webhooks signatures checked before any
// claim, the re-drive route behind the service key, and an event whose worker
// is killed with SIGKILL after it was acknowledged, finished by the next
// worker's re-drive, once at the downstream service. With the Rust gate
// (examples/webhook_gate.rs) beside it: one body limit, enforced before the
// signature, the same in both.

import assert from "node:assert/strict";
import { Webhook } from "standardwebhooks";
import { DEFAULT_WEBHOOK_BODY_LIMIT_BYTES, sha256HexOfBytes } from "../_shared/idempotency/mod.ts";
import {
  idem,
  idemRedrive,
  KEY,
  killHard as kill,
  plane,
  serve,
  sleep,
  superuserSql,
  uniqueKey,
  URL_,
} from "./support.ts";

const SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/** The function's IDEM_ROUTE_SECRET: what a pg_cron job sends, from Vault, instead of the service key. */
const ROUTE_SECRET = "route-secret-4f0c2b7e9a1d4c3b8e6f5a7d9c1b3e5f";
const signer = new Webhook(SECRET);

/** The downstream service PROCESS_URL names: counts requests per Idempotency-Key; `hold` keeps them unanswered. */
function downstream() {
  const seen = new Map<string, number>();
  const done = new Set<string>();
  let hold = false;
  const waiting: (() => void)[] = [];
  const server = Deno.serve({ port: 0, hostname: "127.0.0.1", onListen() {} }, async (request) => {
    const key = request.headers.get("idempotency-key") ?? "";
    await request.arrayBuffer();
    seen.set(key, (seen.get(key) ?? 0) + 1);
    if (hold) await new Promise<void>((resolve) => waiting.push(resolve));
    done.add(key);
    return new Response("{}", { status: 200 });
  });
  return {
    url: `http://127.0.0.1:${server.addr.port}/`,
    seen,
    done,
    hold(on: boolean) {
      hold = on;
      if (!on) waiting.splice(0).forEach((resolve) => resolve());
    },
    async close() {
      this.hold(false);
      await server.shutdown();
    },
  };
}

/** The function as a process: its URL once it printed `listening on …`. */
async function start(processUrl: string) {
  return await serve(Deno.execPath(), ["run", "--frozen", "--allow-net", "--allow-env", "webhooks/index.ts"], {
    IDEM_POSTGREST_URL: URL_,
    IDEM_SERVICE_KEY: KEY,
    IDEM_MAX_ROWS: Deno.env.get("IDEM_MAX_ROWS") ?? "1000",
    PORT: "0",
    WEBHOOK_SECRET: SECRET,
    PROCESS_URL: processUrl,
    HEARTBEAT_LEASE_MS: "3000",
    IDEM_ROUTE_SECRET: ROUTE_SECRET,
  });
}

function signed(id: string, body: string, headers: Record<string, string> = {}): RequestInit {
  const timestamp = new Date();
  const signature = signer.sign(id, timestamp, body);
  return {
    method: "POST",
    headers: {
      "webhook-id": id,
      "webhook-timestamp": String(Math.floor(timestamp.getTime() / 1000)),
      "webhook-signature": signature,
      ...headers,
    },
    body,
  };
}

Deno.test("the example function verifies signatures before any claim and keeps its re-drive route behind the service key", async () => {
  const service = downstream();
  const fn = await start(service.url);
  try {
    const id = uniqueKey("msg");
    const body = JSON.stringify({ type: "user.created", id });
    const first = await fetch(fn.url, signed(id, body));
    assert.deepEqual([first.status, await first.json()], [200, { ack: "processed" }]);
    const again = await fetch(fn.url, signed(id, body));
    assert.deepEqual([again.status, await again.json()], [200, { ack: "dropped", drop_reason: "duplicate" }]);
    assert.deepEqual([...service.seen.values()], [1], "processed once");

    const forged = await fetch(fn.url, signed(uniqueKey("msg"), body, { "webhook-signature": "v1,Zm9yZ2Vk" }));
    assert.equal(forged.status, 401);
    await forged.body?.cancel();
    const unsigned = await fetch(fn.url, { method: "POST", headers: { "webhook-id": uniqueKey("msg") }, body });
    assert.equal(unsigned.status, 401);
    await unsigned.body?.cancel();
    const stale = signer.sign(id, new Date(Date.now() - 3_600_000), body);
    const old = await fetch(fn.url, {
      method: "POST",
      headers: {
        "webhook-id": uniqueKey("msg"),
        "webhook-timestamp": String(Math.floor(Date.now() / 1000) - 3600),
        "webhook-signature": stale,
      },
      body,
    });
    assert.equal(old.status, 401, "a stale delivery is refused");
    await old.body?.cancel();
    assert.equal(service.seen.size, 1, "nothing refused reached processing");

    for (const authorization of [undefined, "Bearer nope", `Bearer ${KEY}x`]) {
      const refused = await fetch(`${fn.url}/redrive`, {
        method: "POST",
        headers: authorization ? { authorization } : {},
      });
      assert.equal(refused.status, 401, String(authorization));
      await refused.body?.cancel();
    }
    const redrive = await fetch(`${fn.url}/redrive`, { method: "POST", headers: { authorization: `Bearer ${KEY}` } });
    assert.deepEqual([redrive.status, await redrive.json()], [200, {
      redriven: 0,
      journaled: 0,
      dead_lettered: 0,
      left: 0,
    }]);
    for (const body of ["nope", '{"limit":0}', '{"limit":1001}', '{"limit":1.5}', '{"scope":"webhook.stripe"}']) {
      const bad = await fetch(`${fn.url}/redrive`, {
        method: "POST",
        headers: { authorization: `Bearer ${KEY}` },
        body,
      });
      assert.equal(bad.status, 400, body);
      await bad.body?.cancel();
    }
    // The Supabase Cron recipe's request, as pg_net would send it: its path
    // and body, read from the recipe, are what the route serves; the key
    // comes from Vault, never from the job's text.
    const recipe = await Deno.readTextFile("../../sql/recipes/pg_cron_redrive.sql");
    const job = recipe.slice(recipe.indexOf("select cron.schedule("));
    assert.ok(!/sb_secret_\w|eyJ\w/.test(job), "no key in the job's text");
    assert.match(
      job,
      /'Bearer ' \|\| \(select decrypted_secret from vault\.decrypted_secrets\s+where name = 'idempotency_route_secret'\)/,
    );
    const path = /'(\/functions\/v1\/webhooks\/redrive)'/.exec(job)?.[1];
    const recipeBody = /body := '([^']+)'::jsonb/.exec(job)?.[1];
    assert.ok(path && recipeBody, job);
    const scheduled = await fetch(new URL(path, fn.url), {
      method: "POST",
      headers: { "content-type": "application/json", authorization: `Bearer ${ROUTE_SECRET}` },
      body: recipeBody,
    });
    assert.deepEqual([scheduled.status, await scheduled.json()], [200, {
      redriven: 0,
      journaled: 0,
      dead_lettered: 0,
      left: 0,
    }]);
    // `idem redrive`: a pass that took nothing exits 0; a route that refuses
    // the key exits 1 and says so; a bound above the row cap is a usage
    // error (2), refused before any request.
    const quiet = await idemRedrive(`${fn.url}/redrive`);
    assert.equal(quiet.code, 0, quiet.stderr);
    assert.deepEqual(JSON.parse(quiet.stdout), { redriven: 0, journaled: 0, dead_lettered: 0, left: 0 });
    const wrongRoute = await idemRedrive(fn.url);
    assert.equal(wrongRoute.code, 1, wrongRoute.stdout);
    assert.match(wrongRoute.stderr, /re-drive failed/);
    const tooMany = await idemRedrive(`${fn.url}/redrive`, "--bound", "1001");
    assert.equal(tooMany.code, 2, tooMany.stderr);
    assert.match(tooMany.stderr, /row cap/);
  } finally {
    await kill(fn.child);
    await service.close();
  }
});

Deno.test("an event acknowledged by a worker killed with SIGKILL mid-processing is finished by the next worker's re-drive", async () => {
  const service = downstream();
  const first = await start(service.url);
  const id = uniqueKey("msg");
  const body = JSON.stringify({ type: "invoice.paid", id });
  let second: Awaited<ReturnType<typeof start>> | undefined;
  try {
    service.hold(true);
    const ack = await fetch(first.url, signed(id, body));
    assert.deepEqual([ack.status, await ack.json()], [200, { ack: "accepted" }], "ACKed while processing runs");
    assert.equal([...service.seen.values()].reduce((a, b) => a + b, 0), 1, "processing reached downstream");
    await kill(first.child);
    service.hold(false);

    // The vendor never redelivers an ACKed event: only the re-drive can
    // finish it, once the dead worker's lease (3 s) has passed.
    // The re-drive is asked for the way an operator without pg_cron
    // schedules it: `idem redrive --to <route>`.
    second = await start(service.url);
    let counts: Record<string, number> = {};
    for (let poll = 0; poll < 40; poll++) {
      await sleep(250);
      const pass = await idemRedrive(`${second.url}/redrive`, "--bound", "10");
      assert.equal(pass.code, 0, pass.stderr);
      counts = JSON.parse(pass.stdout);
      if (counts.redriven > 0) break;
    }
    assert.deepEqual(counts, { redriven: 1, journaled: 1, dead_lettered: 0, left: 0 });
    const keys = [...service.seen.keys()];
    assert.equal(keys.length, 1, "both tries carried the same vendor key, so downstream applies it once");
    assert.deepEqual([...service.done], keys);
    const redelivered = await fetch(second.url, signed(id, body));
    assert.deepEqual(await redelivered.json(), { ack: "dropped", drop_reason: "duplicate" });
  } finally {
    await kill(first.child);
    if (second) await kill(second.child);
    await service.close();
  }
});

/** Both example receivers: the Edge Function under Deno and the Rust gate's process. */
function receivers(): { name: string; command: string; args: string[] }[] {
  const gate = Deno.env.get("WEBHOOK_GATE_BIN");
  if (!gate) throw new Error("WEBHOOK_GATE_BIN is not set: run the tests through tests/run.sh");
  return [
    {
      name: "Edge Function (Deno)",
      command: Deno.execPath(),
      args: ["run", "--frozen", "--allow-net", "--allow-env", "webhooks/index.ts"],
    },
    { name: "Rust gate", command: gate, args: [] },
  ];
}

/** A JSON event of exactly `size` bytes. */
function eventOf(id: string, size: number): string {
  const head = JSON.stringify({ type: "message.created", id, text: "" }).slice(0, -2);
  return head + "w".repeat(size - head.length - 2) + '"}';
}

for (const receiver of receivers()) {
  Deno.test(`${receiver.name}: one body limit, 256 KiB by default: a signed event at it is taken and stored; one byte more is 413 before its signature is checked`, async () => {
    assert.equal(DEFAULT_WEBHOOK_BODY_LIMIT_BYTES, 256 * 1024);
    const service = downstream();
    const organizationId = crypto.randomUUID();
    const env = (extra: Record<string, string> = {}) => ({
      IDEM_POSTGREST_URL: URL_,
      IDEM_SERVICE_KEY: KEY,
      IDEM_MAX_ROWS: Deno.env.get("IDEM_MAX_ROWS") ?? "1000",
      PORT: "0",
      WEBHOOK_SECRET: SECRET,
      PROCESS_URL: service.url,
      ORGANIZATION_ID: organizationId,
      HEARTBEAT_LEASE_MS: "3000",
      ...extra,
    });
    const fn = await serve(receiver.command, receiver.args, env());
    let narrow: Awaited<ReturnType<typeof serve>> | undefined;
    try {
      // At the limit (and far above the 104 KB event 64 KiB of work refused).
      const id = uniqueKey("msg");
      const body = eventOf(id, DEFAULT_WEBHOOK_BODY_LIMIT_BYTES);
      assert.equal(new TextEncoder().encode(body).length, DEFAULT_WEBHOOK_BODY_LIMIT_BYTES);
      const taken = await fetch(fn.url, signed(id, body));
      assert.deepEqual([taken.status, await taken.json()], [200, { ack: "processed" }]);
      const read = await plane().read({
        organizationId,
        scope: "webhook.standard",
        key: id,
        requestHash: await sha256HexOfBytes(new TextEncoder().encode(body)),
      });
      assert.equal(read.outcome, "completed", JSON.stringify(read));
      const again = await fetch(fn.url, signed(id, body));
      assert.deepEqual(await again.json(), { ack: "dropped", drop_reason: "duplicate" });

      // One byte more: refused for its size whatever its signature, so a
      // forged one is 413 too, not 401: nothing else was done with it.
      const over = eventOf(id, DEFAULT_WEBHOOK_BODY_LIMIT_BYTES + 1);
      const forgedHeaders = { "webhook-signature": "v1,Zm9yZ2Vk" };
      for (const init of [signed(uniqueKey("msg"), over), signed(uniqueKey("msg"), over, forgedHeaders)]) {
        const refused = await fetch(fn.url, init);
        assert.equal(refused.status, 413);
        assert.deepEqual(await refused.json(), {
          ack: "rejected",
          reason: "body_too_large",
          error: `the body is larger than this endpoint reads (${DEFAULT_WEBHOOK_BODY_LIMIT_BYTES} bytes)`,
        });
      }
      assert.equal(service.seen.size, 1, "nothing refused reached processing");

      // The deployment's variable sets the limit (the one idem doctor checks).
      narrow = await serve(receiver.command, receiver.args, env({ IDEM_WEBHOOK_BODY_LIMIT_BYTES: "1024" }));
      const small = eventOf(uniqueKey("msg"), 1024);
      const fits = await fetch(narrow.url, signed(uniqueKey("msg"), small));
      assert.deepEqual([fits.status, await fits.json()], [200, { ack: "processed" }]);
      const above = await fetch(narrow.url, signed(uniqueKey("msg"), eventOf(uniqueKey("msg"), 1025)));
      assert.equal(above.status, 413);
      assert.equal((await above.json()).error, "the body is larger than this endpoint reads (1024 bytes)");
    } finally {
      await kill(fn.child);
      if (narrow) await kill(narrow.child);
      await service.close();
    }
  });
}

/**
 * pg_net's tables and `net.http_post` as pg_net declares them (its
 * function security definer, as pg_net's is), and Vault's
 * `decrypted_secrets`, in the database served: pg_net is not packaged for
 * this machine's PostgreSQL, so `sendQueued` below does what its background
 * worker does (send each queued request, write its answer to
 * `net._http_response`) with a real HTTP call to the function.
 */
const PG_NET_STAND_IN = `
  create schema if not exists net;
  create table if not exists net.http_request_queue (
    id bigserial primary key, method text not null, url text not null, headers jsonb not null,
    body bytea, timeout_milliseconds integer not null);
  create table if not exists net._http_response (
    id bigint, status_code integer, content_type text, headers jsonb, content text,
    timed_out boolean, error_msg text, created timestamptz not null default now());
  create or replace function net.http_post(
    url text, body jsonb default '{}'::jsonb, params jsonb default '{}'::jsonb,
    headers jsonb default '{"Content-Type": "application/json"}'::jsonb,
    timeout_milliseconds integer default 5000) returns bigint
  language sql security definer as $f$
    insert into net.http_request_queue (method, url, headers, body, timeout_milliseconds)
    values ('POST', url, headers, convert_to(body::text, 'UTF8'), timeout_milliseconds)
    returning id
  $f$;
  create schema if not exists vault;
  create table if not exists vault.decrypted_secrets (name text primary key, decrypted_secret text);
  -- The job's role, as Supabase's postgres is: no superuser, a member of
  -- service_role (what the plane's functions are granted to), with pg_net and Vault.
  do $r$ begin
    if not exists (select from pg_roles where rolname = 'cron_job_runner') then
      create role cron_job_runner nologin nosuperuser inherit in role service_role;
    end if;
  end $r$;
  grant usage on schema net, vault to cron_job_runner;
  grant select on vault.decrypted_secrets, net._http_response to cron_job_runner;`;

/** pg_net's worker, once: sends every queued request and records its answer. */
async function sendQueued(): Promise<number[]> {
  const queued = await superuserSql(
    "with sent as (delete from net.http_request_queue returning *) " +
      "select id, url, headers::text, convert_from(body, 'UTF8') from sent order by id",
  );
  const statuses: number[] = [];
  for (const [id, url, headers, body] of queued) {
    const answer = await fetch(url, { method: "POST", headers: JSON.parse(headers), body });
    const content = await answer.text();
    statuses.push(answer.status);
    await superuserSql(
      `insert into net._http_response (id, status_code, content) values (${Number(id)}, ${answer.status}, ` +
        `${sqlText(content)})`,
    );
  }
  return statuses;
}

/** `text` as a SQL string literal (dollar-quoted, with a tag the text cannot hold). */
function sqlText(text: string): string {
  const tag = `t${crypto.randomUUID().replaceAll("-", "")}`;
  return `$${tag}$${text}$${tag}$`;
}

Deno.test("the Supabase Cron re-drive recipe sends the route secret, records each call's HTTP status, and idem doctor names a failed one", async () => {
  const service = downstream();
  const fn = await start(service.url);
  try {
    await superuserSql(PG_NET_STAND_IN);
    await superuserSql(
      `delete from vault.decrypted_secrets; insert into vault.decrypted_secrets values ` +
        `('project_url', ${sqlText(fn.url)}), ('idempotency_route_secret', ${sqlText(ROUTE_SECRET)})`,
    );
    // The job's command, exactly as the recipe schedules it.
    const recipe = await Deno.readTextFile("../../sql/recipes/pg_cron_redrive.sql");
    const command = /\$\$([\s\S]+?)\$\$/.exec(recipe.slice(recipe.indexOf("select cron.schedule(")))?.[1];
    assert.ok(command, recipe);
    const job = "idempotency-redrive-webhooks";
    // As the job's role, not a superuser: what the plane grants reaches it through service_role.
    const run = async () => (await superuserSql(`set role cron_job_runner; ${command}`)).at(-1)?.[0];

    // Two runs: the first call answered 200, recorded by the second run.
    assert.equal(await run(), "0", "no answer to record yet");
    const [queued] = await superuserSql("select headers::text from net.http_request_queue");
    assert.ok(
      queued[0].includes(`Bearer ${ROUTE_SECRET}`) && !queued[0].includes(KEY),
      "the route secret, never the service key",
    );
    assert.deepEqual(await sendQueued(), [200]);
    assert.equal(await run(), "1", "the first call's answer recorded");
    await sendQueued();
    assert.deepEqual(await superuserSql("select * from agent.idempotency_scheduled_failures()"), []);
    const healthy = await idem("doctor");
    assert.match(healthy.stdout, /ok +scheduled calls: no scheduled call failed in the last hour/);

    // A secret the function does not hold: 401, which pg_cron would call succeeded.
    await superuserSql(
      "update vault.decrypted_secrets set decrypted_secret = 'stale-secret-0000000000000000000000' where name = 'idempotency_route_secret'",
    );
    await run();
    assert.deepEqual(await sendQueued(), [401]);
    await run();
    const failed = await superuserSql(
      "select job, status_code, failed_calls from agent.idempotency_scheduled_failures()",
    );
    assert.deepEqual(failed, [[job, "401", "1"]]);
    const doctor = await idem("doctor");
    assert.equal(doctor.code, 1, doctor.stdout);
    assert.match(
      doctor.stdout,
      /FAIL +scheduled calls: 1 call\(s\) of idempotency-redrive-webhooks failed in the last hour .*HTTP 401/,
    );
  } finally {
    await superuserSql(
      "delete from agent.idempotency_scheduled_calls; drop schema if exists net cascade; " +
        "drop schema if exists vault cascade; drop role if exists cron_job_runner",
    );
    await kill(fn.child);
    await service.close();
  }
});
