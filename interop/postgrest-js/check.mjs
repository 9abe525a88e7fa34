// Calls the idempotency plane's SQL surface with @supabase/postgrest-js, the
// way a Supabase Edge Function would: one PostgrestClient on schema `agent`,
// the service-role key as a Bearer token, every decision made by the
// agent.idempotency_* functions.
//
//   IDEM_POSTGREST_URL=http://127.0.0.1:PORT IDEM_SERVICE_KEY=... IDEM_MAX_ROWS=1000 node check.mjs
//
// Prints one line per check; exits 1 on the first failure, 2 on bad
// configuration.

import { createHash, createHmac, randomBytes, randomUUID } from 'node:crypto';
import { isDeepStrictEqual } from 'node:util';

import { PostgrestClient } from '@supabase/postgrest-js';

const REQUEST_TIMEOUT_MS = 15_000;

function configuration() {
  const url = (process.env.IDEM_POSTGREST_URL ?? '').replace(/\/+$/, '');
  const key = process.env.IDEM_SERVICE_KEY ?? '';
  const maxRowsText = process.env.IDEM_MAX_ROWS ?? '1000';
  const maxRows = Number(maxRowsText);
  const problems = [];
  if (!url) problems.push('IDEM_POSTGREST_URL is not set (the PostgREST root, e.g. http://127.0.0.1:3000)');
  if (!key) problems.push('IDEM_SERVICE_KEY is not set (the service_role JWT)');
  if (!Number.isInteger(maxRows) || maxRows < 1) problems.push(`IDEM_MAX_ROWS must be a positive integer, got '${maxRowsText}'`);
  if (problems.length > 0) {
    for (const problem of problems) console.error(`config: ${problem}`);
    process.exit(2);
  }
  return { url, key, maxRows };
}

const { url, key, maxRows } = configuration();

// The last response's headers, so a check can read Content-Range itself; and
// a bound on every request, so a stuck server fails the check instead of CI.
let lastResponse = null;
async function recordingFetch(input, init = {}) {
  const response = await fetch(input, { ...init, signal: init.signal ?? AbortSignal.timeout(REQUEST_TIMEOUT_MS) });
  lastResponse = { status: response.status, contentRange: response.headers.get('content-range') };
  return response;
}

function client(headers) {
  return new PostgrestClient(url, { headers, schema: 'agent', fetch: recordingFetch });
}

const service = client({ Authorization: 'Bearer ' + key });

class CheckFailed extends Error {}

function fail(message, detail) {
  const rendered = detail === undefined ? '' : `\n       ${JSON.stringify(detail)}`;
  throw new CheckFailed(message + rendered);
}

function expect(condition, message, detail) {
  if (!condition) fail(message, detail);
}

/** Fails unless the call answered without an error; answers its data. */
function answered(name, response) {
  if (response.error) {
    fail(`${name} answered an error (HTTP ${response.status})`, response.error);
  }
  return response.data;
}

/** Fails unless `data` is an array of exactly one row; answers the row. */
function oneRow(name, data) {
  expect(Array.isArray(data) && data.length === 1, `${name} should answer exactly one row`, data);
  return data[0];
}

let passed = 0;
async function check(name, body) {
  try {
    const note = await body();
    passed += 1;
    console.log(`ok    ${name}${note ? ` (${note})` : ''}`);
  } catch (error) {
    if (error instanceof CheckFailed) {
      console.log(`FAIL  ${name}: ${error.message}`);
    } else {
      console.log(`FAIL  ${name}: ${error?.stack ?? error}`);
    }
    console.log(`postgrest-js interop: ${passed} passed, failed at '${name}' (server ${url})`);
    process.exit(1);
  }
}

/** SHA-256 hex of the request, as the plane stores it (64 lowercase hex digits). */
function requestHash(request) {
  return createHash('sha256').update(JSON.stringify(request)).digest('hex');
}

/** An HS256 JWT for `role`, signed with a secret the server does not know. */
function wrongSecretToken(role) {
  const encode = (value) => Buffer.from(JSON.stringify(value)).toString('base64url');
  const now = Math.floor(Date.now() / 1000);
  const unsigned = `${encode({ alg: 'HS256', typ: 'JWT' })}.${encode({ role, iat: now, exp: now + 600 })}`;
  const signature = createHmac('sha256', randomBytes(32)).update(unsigned).digest('base64url');
  return `${unsigned}.${signature}`;
}

const organization = randomUUID();
const scope = 'interop.postgrest_js';
const LEASE_MS = 30_000;
const RETAIN_MS = 3_600_000;

function claimArgs(claimKey, hash, token) {
  return {
    p_organization_id: organization,
    p_scope: scope,
    p_key: claimKey,
    p_request_hash: hash,
    p_lease_token: token,
    p_lease_ms: LEASE_MS,
    p_retain_ms: RETAIN_MS,
  };
}

console.log(`postgrest-js interop against ${url} (schema agent, max rows ${maxRows})`);

const claimKey = `interop-${randomUUID()}`;
const hash = requestHash({ to: 'a@example.com', subject: 'Hello', key: claimKey });
const token = randomUUID();
const response = { message_id: `m-${randomUUID()}`, status: 'sent', accepted: ['a@example.com'] };
let claimed;
let completed;

await check('try_claim with a fresh key answers one processing row with a live lease', async () => {
  const data = answered('idempotency_try_claim', await service.rpc('idempotency_try_claim', claimArgs(claimKey, hash, token)));
  claimed = oneRow('idempotency_try_claim', data);
  expect(claimed.status === 'processing', "status should be 'processing'", claimed);
  expect(claimed.lease_live === true, 'lease_live should be true', claimed);
  expect(claimed.lease_token === token, 'the row should carry our lease token', claimed);
  expect(claimed.key === claimKey && claimed.scope === scope && claimed.organization_id === organization,
    'the row should carry our organization, scope and key', claimed);
  expect(claimed.request_hash === hash, 'the row should carry our request hash', claimed);
  expect(typeof claimed.id === 'string' && claimed.id.length === 36, 'the row should have a uuid id', claimed);
  return `id ${claimed.id}`;
});

await check('try_claim repeated with the same token answers our own row', async () => {
  const data = answered('idempotency_try_claim', await service.rpc('idempotency_try_claim', claimArgs(claimKey, hash, token)));
  const row = oneRow('idempotency_try_claim (repeat)', data);
  expect(row.id === claimed.id && row.lease_token === token && row.lease_live === true,
    'a repeat with the same token should answer the same live claim', row);
});

await check('try_claim with another token answers [] (already claimed)', async () => {
  const data = answered('idempotency_try_claim',
    await service.rpc('idempotency_try_claim', claimArgs(claimKey, hash, randomUUID())));
  expect(Array.isArray(data) && data.length === 0, 'a second claimer should get no row', data);
});

await check('get answers the processing row', async () => {
  const data = answered('idempotency_get', await service.rpc('idempotency_get', {
    p_organization_id: organization, p_scope: scope, p_key: claimKey,
  }));
  const row = oneRow('idempotency_get', data);
  expect(row.id === claimed.id && row.status === 'processing' && row.lease_live === true && row.lease_token === token,
    'get should answer the same processing claim with a live lease', row);
});

await check('complete with a response answers the completed row', async () => {
  const data = answered('idempotency_complete', await service.rpc('idempotency_complete', {
    p_claim_id: claimed.id, p_lease_token: token, p_response: response,
  }));
  completed = oneRow('idempotency_complete', data);
  expect(completed.id === claimed.id, 'complete should answer the claimed row', completed);
  expect(completed.status === 'completed', "status should be 'completed'", completed);
  expect(completed.lease_live === false, 'a completed row holds no lease (lease_live false)', completed);
  expect(isDeepStrictEqual(completed.response, response), 'the stored response should be ours, verbatim', completed);
  expect(completed.resource_type === null && completed.resource_id === null, 'no resource was given', completed);
});

await check('complete repeated with the same token and response answers the same row', async () => {
  const data = answered('idempotency_complete', await service.rpc('idempotency_complete', {
    p_claim_id: claimed.id, p_lease_token: token, p_response: response,
  }));
  const row = oneRow('idempotency_complete (repeat)', data);
  expect(isDeepStrictEqual(row, completed), 'a repeat should answer the row the first completion answered',
    { first: completed, repeat: row });
});

await check('get after complete answers the completed row (the replay)', async () => {
  const data = answered('idempotency_get', await service.rpc('idempotency_get', {
    p_organization_id: organization, p_scope: scope, p_key: claimKey,
  }));
  const row = oneRow('idempotency_get', data);
  expect(row.status === 'completed' && isDeepStrictEqual(row.response, response),
    'get should replay the stored response', row);
});

await check('claim then release answers true, a second release false', async () => {
  const releaseKey = `interop-release-${randomUUID()}`;
  const releaseToken = randomUUID();
  const data = answered('idempotency_try_claim', await service.rpc('idempotency_try_claim',
    claimArgs(releaseKey, requestHash({ key: releaseKey }), releaseToken)));
  const row = oneRow('idempotency_try_claim', data);
  expect(row.status === 'processing' && row.lease_live === true, 'the second claim should be processing and live', row);
  const args = { p_claim_id: row.id, p_lease_token: releaseToken };
  const first = answered('idempotency_release', await service.rpc('idempotency_release', args));
  expect(first === true, 'the first release should answer true', first);
  const second = answered('idempotency_release', await service.rpc('idempotency_release', args));
  expect(second === false, 'a second release should answer false', second);
  const after = answered('idempotency_get', await service.rpc('idempotency_get', {
    p_organization_id: organization, p_scope: scope, p_key: releaseKey,
  }));
  expect(Array.isArray(after) && after.length === 0, 'a released key should be gone', after);
});

await check(`a bounded expired read (p_limit ${maxRows}, count exact) agrees with Content-Range`, async () => {
  lastResponse = null;
  const result = await service
    .rpc('idempotency_expired', { p_limit: maxRows }, { count: 'exact' })
    .select('id,retain_until');
  const data = answered('idempotency_expired', result);
  expect(Array.isArray(data), 'idempotency_expired should answer an array', data);
  expect(typeof result.count === 'number', 'count should be a number (from Content-Range)',
    { count: result.count, contentRange: lastResponse?.contentRange });
  expect(result.count === data.length, 'count should equal the rows answered (nothing was truncated)',
    { count: result.count, rows: data.length, contentRange: lastResponse?.contentRange });
  expect(data.length <= maxRows, `at most ${maxRows} rows`, data.length);
  for (const row of data) {
    expect(isDeepStrictEqual(Object.keys(row).sort(), ['id', 'retain_until']), 'select=id,retain_until should shape rows', row);
  }
  const contentRange = lastResponse?.contentRange ?? '';
  const expected = data.length === 0 ? `*/${result.count}` : `0-${data.length - 1}/${result.count}`;
  expect(contentRange === expected, `Content-Range should be '${expected}'`, contentRange);
  return `count ${result.count}, Content-Range ${contentRange}`;
});

async function refused(name, anonymous) {
  const result = await anonymous.rpc('idempotency_get', {
    p_organization_id: organization, p_scope: scope, p_key: claimKey,
  });
  expect(result.error, `${name} should be refused, but got data`, result.data);
  expect(result.status === 401, `${name} should be refused with 401`, { status: result.status, error: result.error });
  return `401 ${result.error.code ?? ''}`.trim();
}

await check('a call without Authorization (anon) is refused', async () => refused('anon', client({})));

await check('a service_role token signed with the wrong secret is refused', async () =>
  refused('a wrong-secret token', client({ Authorization: 'Bearer ' + wrongSecretToken('service_role') })));

console.log(`postgrest-js interop: all ${passed} checks passed`);
