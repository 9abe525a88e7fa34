// A Supabase Queues consumer whose effects happen once, as a Supabase Edge
// Function:
//
//   POST /   the route secret IDEM_ROUTE_SECRET (what a pg_cron job sends,
//            from Vault) or the service key, as `Authorization: Bearer` or
//            `apikey` (`callerAuthorized`): drains one batch (up to
//            BATCH messages, default 10) of the queue QUEUE_NAME and answers
//            the counts `{"read", "ran", "replayed", "failed", "archived",
//            "dead_lettered", "left", "redriven"}`; anything else gets 401
//
// A message is JSON `{"idempotency_key": "…", "payload": …}`: the producer's
// key names the command, so a producer that sends the same command twice
// (a retry after a timeout) sends the same key, and its effect happens once.
// Processing forwards `payload` to PROCESS_URL (POST, with the tenant's vendor
// key as `Idempotency-Key`) and is done when that answers 2xx; a 4xx (other
// than 408, 409 and 429) is a failure for good, journaled and sent with the
// message to DEAD_LETTER_QUEUE (default QUEUE_NAME_dlq), once per command;
// anything else leaves the message to come back when its visibility passes,
// until MAX_READS (default 5) reads dead-letter it. A message no client can
// read (not an object, a key that is not a string, a number beyond every
// double) is dead-lettered alone, as its text; the rest of its batch runs.
// Where the plane has its queue functions, a batch is read and claimed in
// one transaction and settled in another, and failures sent back after a fix
// (`idem redrive --failed --scope queue.<QUEUE_NAME> ...`) run again on a
// later drain, without their message.
//
// The plane and the queues come from the environment (SUPABASE_URL and the
// service key on Supabase; `idem up --env-file` writes IDEM_POSTGREST_URL and
// IDEM_SERVICE_KEY). Also ORGANIZATION_ID (the tenant of the queue's
// messages), ORGANIZATIONS (for a queue shared by tenants: the organizations,
// comma-separated, whose messages this consumer takes, each message naming
// its own `organization_id`; ORGANIZATION_ID's by default), QUEUE_PATH (auto,
// the default, plane or data_api: see `QueuePath`), and the timing:
// EFFECT_TIMEOUT_MS (default 10 000), JOURNAL_DEADLINE_MS (10 000) and
// LEASE_MARGIN_MS (5 000), whose sum is each claim's lease; a message read
// stays hidden for the lease and a second more. With HEARTBEAT_LEASE_MS
// (at least 3 000), claims take that short lease instead, kept alive by
// heartbeats (which keep the messages hidden too) while effects run. Deployed,
// the schedule that calls it names the database's region in its URL
// (`?forceFunctionRegion=<region>`; docs/deploying.md): every take, settle
// and heartbeat is a round trip to the database. Locally:
//
//   idem up --with-pgmq --queue orders --queue orders_dlq --env-file plane.env &
//   set -a; . ./plane.env; set +a
//   export QUEUE_NAME=orders PROCESS_URL=http://127.0.0.1:9000/
//   cd supabase/functions && PORT=8082 deno run --allow-net --allow-env queue-consumer/index.ts
//
// On Supabase: create the queues (Integrations > Queues), expose them to the
// Data API (Queues > Settings > "Expose Queues via PostgREST"; the consumer
// needs nothing but the service role), deploy with `supabase functions deploy
// queue-consumer --no-verify-jwt`, and schedule it with
// sql/recipes/pg_cron_queue_consumer.sql.

import {
  callerAuthorized,
  EffectDriver,
  failure,
  IdempotencyPlane,
  QueueConsumer,
  type QueuePath,
  Queues,
  routeCredentials,
  serviceKeyFromEnv,
  type Settle,
  success,
  Timing,
} from "../_shared/idempotency/mod.ts";

/** The tenant of the queue's messages when ORGANIZATION_ID is not set. */
const DEMO_ORGANIZATION = "00000000-0000-4000-8000-000000000001";

function required(
  env: (name: string) => string | undefined,
  name: string,
): string {
  const value = env(name);
  if (!value) throw new Error(`set ${name}`);
  return value;
}

function whole(
  env: (name: string) => string | undefined,
  name: string,
  fallback: number,
): number {
  const value = Number(env(name) ?? fallback);
  if (!Number.isInteger(value) || value < 1) {
    throw new Error(`${name} must be a positive integer`);
  }
  return value;
}

/** The handler for this function, over `plane` and `queues`. */
export function consumer(
  plane: IdempotencyPlane,
  queues: Queues,
  env: (name: string) => string | undefined = Deno.env.get,
) {
  const queue = required(env, "QUEUE_NAME");
  const processUrl = required(env, "PROCESS_URL");
  const credentials = routeCredentials(env);
  const effectMs = whole(env, "EFFECT_TIMEOUT_MS", 10_000);
  const timing = new Timing(
    effectMs,
    whole(env, "JOURNAL_DEADLINE_MS", 10_000),
    whole(env, "LEASE_MARGIN_MS", 5_000),
  );
  const path = env("QUEUE_PATH") || "auto";
  if (!["auto", "plane", "data_api"].includes(path)) {
    throw new Error("QUEUE_PATH must be auto, plane or data_api");
  }
  const organizations = env("ORGANIZATIONS")?.split(",").map((id) => id.trim())
    .filter((id) => id !== "");
  const drainer = new QueueConsumer(new EffectDriver(plane), queues, {
    queue,
    organizationId: env("ORGANIZATION_ID") ?? DEMO_ORGANIZATION,
    ...(organizations?.length ? { organizations } : {}),
    deadLetterQueue: env("DEAD_LETTER_QUEUE") ?? `${queue}_dlq`,
    batchSize: whole(env, "BATCH", 10),
    maxReads: whole(env, "MAX_READS", 5),
    timing: env("HEARTBEAT_LEASE_MS") ? timing.withHeartbeats(whole(env, "HEARTBEAT_LEASE_MS", 0)) : timing,
    path: path as QueuePath,
  });

  /** Forwards one message's payload downstream; done on 2xx. */
  const forward = async (
    payload: unknown,
    vendorKey: string,
    signal: AbortSignal,
  ): Promise<Settle> => {
    let answer: Response;
    try {
      answer = await fetch(processUrl, {
        method: "POST",
        headers: {
          "content-type": "application/json",
          "idempotency-key": vendorKey,
        },
        body: JSON.stringify(payload),
        signal,
      });
    } catch (error) {
      return {
        unknown: `PROCESS_URL unreachable: ${error instanceof Error ? error.message : error}`,
      };
    }
    await answer.body?.cancel();
    if (answer.ok) return { journal: success({ forwarded: answer.status }) };
    if (answer.status >= 500 || [408, 409, 429].includes(answer.status)) {
      return { unknown: `PROCESS_URL answered ${answer.status}` };
    }
    return { journal: failure("process_failed", { status: answer.status }) };
  };

  return async (request: Request): Promise<Response> => {
    const path = new URL(request.url).pathname.replace(
      /^\/functions\/v1\/queue-consumer/,
      "",
    )
      .replace(/^\/queue-consumer/, "");
    if (
      request.method !== "POST" || (path !== "/" && path !== "") ||
      !callerAuthorized(request, credentials)
    ) {
      await request.body?.cancel();
      return Response.json({
        error: "POST / takes the route secret or the service key",
      }, { status: 401 });
    }
    await request.body?.cancel();
    const drained = await drainer.drain((payload, { vendorKey, signal }) => forward(payload, vendorKey, signal));
    return Response.json(drained);
  };
}

if (import.meta.main) {
  const env = (name: string) => Deno.env.get(name);
  const plane = IdempotencyPlane.fromEnv(env);
  const url = env("IDEM_POSTGREST_URL") ||
    `${(env("SUPABASE_URL") ?? "").replace(/\/+$/, "")}/rest/v1`;
  const key = serviceKeyFromEnv(env)?.key ?? "";
  const handler = consumer(plane, Queues.connect({ url, key }));
  Deno.serve({
    port: Number(env("PORT") ?? 8000),
    hostname: env("HOST") ?? "127.0.0.1",
    onListen({ hostname, port }) {
      // The first line on stdout, with the port bound (PORT=0 picks a free one).
      console.log(
        `listening on http://${hostname.includes(":") ? `[${hostname}]` : hostname}:${port}`,
      );
    },
  }, handler);
}
