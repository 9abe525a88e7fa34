// Calls the idempotency plane's SQL surface with @supabase/postgrest-js, the
// way a Supabase Edge Function would: one PostgrestClient on schema `agent`,
// the service-role key as a Bearer token, every decision made by the
// agent.idempotency_* functions. Request hashes are RFC 8785 (JCS) canonical
// JSON hashed with SHA-256, computed with the `canonicalize` package, and
// with IDEM_BIN set the Rust crate (`idem claim`) repeats requests this
// client made, and the other way round.
//
//   IDEM_POSTGREST_URL=http://127.0.0.1:PORT IDEM_SERVICE_KEY=... IDEM_MAX_ROWS=1000 [IDEM_BIN=path/to/idem] node check.mjs
//
// Prints one line per check; exits 1 on the first failure, 2 on bad
// configuration.

import { execFile } from 'node:child_process';
import { createHash, createHmac, randomBytes, randomUUID } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { isDeepStrictEqual } from 'node:util';

import { PostgrestClient } from '@supabase/postgrest-js';
import canonicalize from 'canonicalize';

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

/** The request hash every client computes: SHA-256 (lowercase hex) of the request's RFC 8785 form. */
function requestHash(request) {
  return createHash('sha256').update(canonicalize(request), 'utf8').digest('hex');
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
const scope = 'tool.interop.send';
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

await check('get answers the processing row without its lease token', async () => {
  const data = answered('idempotency_get', await service.rpc('idempotency_get', {
    p_organization_id: organization, p_scope: scope, p_key: claimKey,
  }));
  const row = oneRow('idempotency_get', data);
  expect(row.id === claimed.id && row.status === 'processing' && row.lease_live === true,
    'get should answer the same processing claim with a live lease', row);
  expect(row.lease_token === null, 'a read never discloses the holder\'s lease token', row);
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

// ---- Surface v2: one call decides, for every client alike -----------------

function oneCall(callKey, callHash, callToken, leaseMs = LEASE_MS, callScope = scope) {
  return {
    p_organization_id: organization,
    p_scope: callScope,
    p_key: callKey,
    p_request_hash: callHash,
    p_lease_token: callToken,
    p_lease_ms: leaseMs,
  };
}

async function claimOnce(name, args) {
  return oneRow(name, answered('idempotency_claim', await service.rpc('idempotency_claim', args)));
}

function discloses(row) {
  return { token: row.lease_token, response: row.response, resource: row.resource_id };
}

const v2Key = `interop-v2-${randomUUID()}`;
const v2Request = { to: 'b@example.com', subject: 'One call', amount: 1 };
const v2Hash = requestHash(v2Request);
const v2Token = randomUUID();
const v2Answer = { message_id: `m-${randomUUID()}`, status: 'sent' };
let v2Claim;

await check('idempotency_claim: a fresh key is claimed, with our token and a live lease', async () => {
  v2Claim = await claimOnce('idempotency_claim', oneCall(v2Key, v2Hash, v2Token));
  expect(v2Claim.outcome === 'claimed' && v2Claim.status === 'processing', "outcome 'claimed', processing", v2Claim);
  expect(v2Claim.lease_token === v2Token && v2Claim.lease_live === true, 'our token, a live lease', v2Claim);
  const window = Date.parse(v2Claim.retain_until) - Date.parse(v2Claim.lease_expires_at);
  expect(window === 30 * 86_400_000, 'a tool claim is kept 30 days past its lease (the scope policy)', v2Claim);
});

await check('idempotency_claim: a repeat with the same token answers our own claim again', async () => {
  const row = await claimOnce('idempotency_claim (repeat)', oneCall(v2Key, v2Hash, v2Token));
  expect(row.outcome === 'claimed' && row.id === v2Claim.id && row.lease_token === v2Token,
    'the caller whose answer was lost gets its own claim back', row);
});

await check('idempotency_claim: another caller gets processing, with no token, response or resource', async () => {
  const row = await claimOnce('idempotency_claim (other)', oneCall(v2Key, v2Hash, randomUUID()));
  expect(row.outcome === 'processing' && row.lease_live === true, "outcome 'processing'", row);
  expect(row.lease_token === null && row.response === null && row.resource_id === null,
    'processing discloses no token, response or resource', discloses(row));
});

await check('idempotency_claim: after completion it replays the stored answer, without the token', async () => {
  answered('idempotency_complete', await service.rpc('idempotency_complete', {
    p_claim_id: v2Claim.id, p_lease_token: v2Token, p_response: v2Answer,
    p_resource_type: 'email.message', p_resource_id: v2Answer.message_id,
  }));
  const row = await claimOnce('idempotency_claim (replay)', oneCall(v2Key, v2Hash, randomUUID()));
  expect(row.outcome === 'completed' && isDeepStrictEqual(row.response, v2Answer), 'the stored answer', row);
  expect(row.resource_id === v2Answer.message_id && row.lease_token === null, 'the resource, no token', row);
});

await check('idempotency_claim: another request under the key is a conflict that discloses nothing', async () => {
  const row = await claimOnce('idempotency_claim (conflict)',
    oneCall(v2Key, requestHash({ ...v2Request, amount: 2 }), randomUUID()));
  expect(row.outcome === 'conflict', "outcome 'conflict'", row);
  expect(row.lease_token === null && row.response === null && row.resource_id === null && row.request_hash === null,
    'a conflict discloses no token, response, resource or stored hash', row);
});

await check('idempotency_claim: a passed lease is reclaimed by the next caller', async () => {
  const key = `interop-reclaim-${randomUUID()}`;
  const hashed = requestHash({ key });
  const first = await claimOnce('idempotency_claim', oneCall(key, hashed, randomUUID(), 1000));
  expect(first.outcome === 'claimed', "outcome 'claimed'", first);
  await new Promise((resolve) => setTimeout(resolve, 1_200));
  const token2 = randomUUID();
  const row = await claimOnce('idempotency_claim (after the lease)', oneCall(key, hashed, token2));
  expect(row.outcome === 'reclaimed' && row.id === first.id && row.lease_token === token2 && row.lease_live === true,
    "outcome 'reclaimed', the same claim under our token", row);
});

/** Fails unless `result` is a PostgREST error with this HTTP status and code. */
function refusedWith(name, result, status, code) {
  expect(result.error, `${name} should be refused, but got data`, result.data);
  expect(result.status === status && result.error.code === code,
    `${name} should be refused with HTTP ${status} ${code}`, { status: result.status, error: result.error });
  return `HTTP ${status} ${code}`;
}

await check('a tool claim cannot be kept less than 30 days: a short p_retain_ms is ignored, the policy table read-only',
  async () => {
    const key = `interop-retain-${randomUUID()}`;
    const row = oneRow('idempotency_try_claim', answered('idempotency_try_claim', await service.rpc(
      'idempotency_try_claim', { ...claimArgs(key, requestHash({ key }), randomUUID()), p_retain_ms: 86_400_000 })));
    const window = Date.parse(row.retain_until) - Date.parse(row.lease_expires_at);
    expect(window === 30 * 86_400_000, 'one day asked, 30 days kept', row);
    const write = await service.from('idempotency_scopes').insert({
      scope: 'tool.interop.short', retain: '1 day', max_response_bytes: 65536,
    });
    expect(write.error, 'writing the policy table should be refused', write);
    return `policy write refused: HTTP ${write.status} ${write.error.code}`;
  });

await check('an unknown scope is refused with IDEM1', async () => {
  const key = `interop-unknown-${randomUUID()}`;
  const result = await service.rpc('idempotency_claim',
    oneCall(key, requestHash({ key }), randomUUID(), LEASE_MS, 'payments.charge'));
  return refusedWith('a claim under an unknown scope', result, 400, 'IDEM1');
});

/** Claims a fresh key, completes it with `response`, expects the refusal `code`, and that the claim stays processing. */
async function refusedCompletion(name, response, code) {
  const key = `interop-refused-${randomUUID()}`;
  const token = randomUUID();
  const row = await claimOnce('idempotency_claim', oneCall(key, requestHash({ key }), token));
  const result = await service.rpc('idempotency_complete', {
    p_claim_id: row.id, p_lease_token: token, p_response: response,
  });
  const refusal = refusedWith(name, result, 400, code);
  const after = oneRow('idempotency_get', answered('idempotency_get', await service.rpc('idempotency_get', {
    p_organization_id: organization, p_scope: scope, p_key: key,
  })));
  expect(after.status === 'processing', 'the refused completion wrote nothing', after);
  return refusal;
}

await check('a response above the scope limit is refused with IDEM2 and the claim stays processing', () =>
  refusedCompletion('a 70 kB response', { text: 'x'.repeat(70_000) }, 'IDEM2'));

await check('a null request hash is refused by name (22023) and takes over nothing', async () => {
  // PostgREST binds a JSON null to SQL NULL (the embedded server to ''):
  // either way the plane refuses it, naming the argument.
  const key = `interop-null-hash-${randomUUID()}`;
  const result = await service.rpc('idempotency_claim', oneCall(key, null, randomUUID()));
  const refusal = refusedWith('a claim with a null hash', result, 400, '22023');
  expect(result.error.message.includes('p_request_hash'), 'the message names p_request_hash', result.error);
  const after = answered('idempotency_get', await service.rpc('idempotency_get', {
    p_organization_id: organization, p_scope: scope, p_key: key,
  }));
  expect(Array.isArray(after) && after.length === 0, 'nothing was written', after);
  return refusal;
});

await check('a response nested deeper than 64 levels is refused with IDEM3 and the claim stays processing', () => {
  let deep = 1;
  for (let level = 0; level < 65; level += 1) deep = [deep];
  return refusedCompletion('a 65-level response', deep, 'IDEM3');
});

await check('the claim table has no endpoint that reads or writes it', async () => {
  const read = await service.from('idempotency_keys').select('*');
  expect(read.error && read.status >= 400 && read.status < 500, 'reading the table is refused', read);
  const write = await service.from('idempotency_keys').insert({
    organization_id: organization, scope, key: `forged-${randomUUID()}`, request_hash: 'b'.repeat(64),
    status: 'completed', lease_token: randomUUID(), response: { forged: true },
    lease_expires_at: '2000-01-01T00:00:00Z', retain_until: '2000-01-01T00:00:00Z',
  });
  expect(write.error && write.status >= 400 && write.status < 500, 'writing the table is refused', write);
  return `read: HTTP ${read.status} ${read.error.code}; write: HTTP ${write.status} ${write.error.code}`;
});

await check('every request-hash vector matches the canonicalize package', async () => {
  const vectors = JSON.parse(readFileSync(new URL('../../tests/vectors/request_hash.json', import.meta.url), 'utf8'));
  expect(vectors.length >= 25, 'at least 25 vectors', vectors.length);
  for (const vector of vectors) {
    expect(canonicalize(vector.input) === vector.canonical, 'canonical form', vector);
    expect(requestHash(vector.input) === vector.sha256, 'sha256', vector);
  }
  return `${vectors.length} vectors`;
});

/** Runs `idem claim` (the Rust crate) for `requestText`; answers its JSON line. */
function rustClaim(key, requestText, leaseMs = LEASE_MS) {
  return new Promise((resolve, reject) => {
    const child = execFile(process.env.IDEM_BIN, [
      'claim', '--hold', '--org', organization, '--scope', scope, '--key', key, '--lease-ms', String(leaseMs),
    ], { timeout: 30_000 }, (error, stdout, stderr) => {
      if (error) reject(new CheckFailed(`idem claim failed: ${error.message}\n${stderr}`));
      else resolve(JSON.parse(stdout));
    });
    child.stdin.end(requestText);
  });
}

if (process.env.IDEM_BIN) {
  await check('cross-language: a request JavaScript completed is replayed, not conflicted, when Rust repeats it',
    async () => {
      const key = `interop-js-first-${randomUUID()}`;
      const request = { to: ['a@example.com', 'c@example.com'], amount: 1.5, meta: { b: 1, a: 'é' } };
      const jsToken = randomUUID();
      const row = await claimOnce('idempotency_claim', oneCall(key, requestHash(request), jsToken));
      answered('idempotency_complete', await service.rpc('idempotency_complete', {
        p_claim_id: row.id, p_lease_token: jsToken, p_response: { sent: true },
      }));
      // The same request as another client writes it: other key order, other number spelling.
      const rust = await rustClaim(key, '{"meta":{"a":"\\u00e9","b":1.0},"amount":15e-1,"to":["a@example.com","c@example.com"]}');
      expect(rust.outcome === 'completed' && isDeepStrictEqual(rust.response, { sent: true }),
        'Rust replays the answer JavaScript stored', rust);
      expect(rust.request_hash === requestHash(request), 'both hash the request alike', rust);
    });

  await check('cross-language: a request Rust claimed is the same request to JavaScript', async () => {
    const key = `interop-rust-first-${randomUUID()}`;
    const rust = await rustClaim(key, '{"subject":"Hi","to":"d@example.com","priority":1e2}');
    expect(rust.outcome === 'claimed', 'Rust claims the fresh key', rust);
    const same = await claimOnce('idempotency_claim',
      oneCall(key, requestHash({ to: 'd@example.com', priority: 100, subject: 'Hi' }), randomUUID()));
    expect(same.outcome === 'processing', 'JavaScript sees the same request in flight, not a conflict', same);
    const other = await claimOnce('idempotency_claim',
      oneCall(key, requestHash({ to: 'd@example.com', priority: 101, subject: 'Hi' }), randomUUID()));
    expect(other.outcome === 'conflict', 'and a different request as a conflict', other);
  });
} else {
  console.log('skip  cross-language checks: IDEM_BIN is not set');
}

console.log(`postgrest-js interop: all ${passed} checks passed`);
