// A webhook receiver whose events outlive its worker, as a Supabase Edge
// Function. Deliveries are signed as Standard Webhooks signs them (the
// `webhook-id`, `webhook-timestamp` and `webhook-signature` headers, as
// Supabase's Auth hooks and Svix send them):
//
//   POST /           a signed delivery: its body read up to the gate's limit
//                    (IDEM_WEBHOOK_BODY_LIMIT_BYTES, default 262144 bytes,
//                    what the webhook.* scope always stores; 413 above it,
//                    the signature unchecked), verified (401 when unsigned,
//                    wrongly signed or stale, and never claimed), claimed with its
//                    body under its `webhook-id`, answered within 2.5 s, and
//                    processed once: its body is forwarded to PROCESS_URL
//                    (POST, with the tenant's vendor key as `Idempotency-Key`)
//                    and done when that answers 2xx
//   POST /redrive    the route secret IDEM_ROUTE_SECRET (what a pg_cron job
//                    sends, from Vault) or the service key, as
//                    `Authorization: Bearer` or `apikey`: re-drives the
//                    events of this function's scope whose worker was stopped
//                    (lease passed, still processing), up to the body's
//                    `{"limit": N}` (default 50), and answers the counts
//                    `{"redriven", "journaled", "dead_lettered", "left"}`;
//                    without a credential, 401; a bad body, 400
//                    (`redriveRoute`, docs/typescript.md)
//
// The plane comes from the environment as in `orders` (SUPABASE_URL and the
// service key on Supabase; `idem up --env-file` writes IDEM_POSTGREST_URL and
// IDEM_SERVICE_KEY). Also: WEBHOOK_SECRET (`whsec_…`), PROCESS_URL, and
// optionally ORGANIZATION_ID (the tenant these deliveries belong to),
// HEARTBEAT_LEASE_MS (default 10 000) and IDEM_WEBHOOK_BODY_LIMIT_BYTES
// (default 262 144; `idem doctor` reads the same variable and checks the
// scope stores a body that large). Deployed, give the vendor the URL with the
// database's region pinned (`?forceFunctionRegion=<region>`; a vendor cannot
// send `x-region`; docs/deploying.md): each claim, journal and heartbeat is a
// round trip to the database. Locally:
//
//   idem up --env-file plane.env &
//   set -a; . ./plane.env; set +a
//   export WEBHOOK_SECRET=whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw PROCESS_URL=http://127.0.0.1:9000/
//   cd supabase/functions && PORT=8081 deno run --allow-net --allow-env webhooks/index.ts
//
// Deploy it with `supabase functions deploy webhooks --no-verify-jwt`: the
// vendor calls it without a Supabase key, so the signature is its
// authentication. Schedule the re-drive with sql/recipes/ (pg_cron calling
// POST /redrive), or `idem redrive`.

import { Webhook } from "standardwebhooks";
import {
  IdempotencyPlane,
  ProcessingError,
  type Redelivery,
  redriveRoute,
  routeCredentials,
  vendorKey,
  WebhookGate,
  webhookHandler,
} from "../_shared/idempotency/mod.ts";

/** The scope of these deliveries: under `webhook.*` (24 h retention, 384 KiB of work, 5 attempts). */
export const SCOPE = "webhook.standard";

/** The tenant of deliveries when ORGANIZATION_ID is not set. */
const DEMO_ORGANIZATION = "00000000-0000-4000-8000-000000000001";

/** The most orphans one call of POST /redrive takes over. */
const REDRIVE_BATCH = 50;

function required(name: string): string {
  const value = Deno.env.get(name);
  if (!value) throw new Error(`set ${name}`);
  return value;
}

/** The handler for this function's routes, over `plane`. */
export function receiver(
  plane: IdempotencyPlane,
  env: (name: string) => string | undefined = Deno.env.get,
) {
  const webhook = new Webhook(
    env("WEBHOOK_SECRET") ?? required("WEBHOOK_SECRET"),
  );
  const processUrl = env("PROCESS_URL") ?? required("PROCESS_URL");
  const organizationId = env("ORGANIZATION_ID") ?? DEMO_ORGANIZATION;
  const bodyLimit = env("IDEM_WEBHOOK_BODY_LIMIT_BYTES");
  const gate = new WebhookGate(plane, {
    heartbeatLeaseMs: Number(env("HEARTBEAT_LEASE_MS") ?? 10_000),
    bodyLimitBytes: bodyLimit ? Number(bodyLimit) : undefined,
  });

  /** Forwards one event downstream; done on 2xx. Stops when `signal` aborts (the gate cut it). */
  const forward = async (
    deliveryId: string,
    body: Uint8Array,
    signal: AbortSignal,
  ): Promise<unknown> => {
    const key = await vendorKey(organizationId, SCOPE, deliveryId);
    let answer: Response;
    try {
      answer = await fetch(processUrl, {
        method: "POST",
        headers: { "content-type": "application/json", "idempotency-key": key },
        body: body as BodyInit,
        signal,
      });
    } catch (error) {
      throw ProcessingError.retryable(
        `PROCESS_URL unreachable: ${error instanceof Error ? error.message : error}`,
      );
    }
    await answer.body?.cancel();
    if (answer.ok) return { forwarded: answer.status };
    const failure = `PROCESS_URL answered ${answer.status}`;
    throw answer.status >= 500 || answer.status === 429
      ? ProcessingError.retryable(failure)
      : ProcessingError.permanent(failure);
  };

  const deliveries = webhookHandler({
    gate,
    scope: SCOPE,
    verify: (request, body) => {
      // Throws on a missing, wrong or stale signature (the timestamp must be
      // within five minutes).
      webhook.verify(
        new TextDecoder().decode(body),
        Object.fromEntries(request.headers),
      );
      return true;
    },
    organizationOf: () => organizationId,
    deliveryIdOf: (request) => request.headers.get("webhook-id") ?? "",
    process: ({ request, body, signal }) => forward(request.headers.get("webhook-id") ?? "", body, signal),
  });

  const redrive = redriveRoute({
    credentials: routeCredentials(env),
    scope: SCOPE,
    maxLimit: plane.maxRows,
    defaultLimit: REDRIVE_BATCH,
    redrive: (limit) =>
      gate.redrive(
        { scope: SCOPE, limit, organizationId },
        (event: Redelivery, signal: AbortSignal) => forward(event.deliveryId, event.body, signal),
      ),
  });

  return (request: Request): Promise<Response> | Response => {
    const path = new URL(request.url).pathname.replace(
      /^\/functions\/v1\/webhooks/,
      "",
    ).replace(/^\/webhooks/, "");
    if (path === "/redrive") return redrive(request);
    if (request.method !== "POST") {
      return new Response(null, { status: 405, headers: { allow: "POST" } });
    }
    if (path === "/" || path === "") return deliveries(request);
    return new Response(null, { status: 404 });
  };
}

if (import.meta.main) {
  const handler = receiver(
    IdempotencyPlane.fromEnv((name) => Deno.env.get(name)),
  );
  Deno.serve({
    port: Number(Deno.env.get("PORT") ?? 8000),
    hostname: Deno.env.get("HOST") ?? "127.0.0.1",
    onListen({ hostname, port }) {
      // The first line on stdout, with the port bound (PORT=0 picks a free one).
      console.log(
        `listening on http://${hostname.includes(":") ? `[${hostname}]` : hostname}:${port}`,
      );
    },
  }, handler);
}
