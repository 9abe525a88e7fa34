// The tenant's key for a vendor's own idempotency (Stripe's
// `Idempotency-Key`, a downstream service's).

import { sha256HexOfBytes } from "./hash.ts";
import { checkOrganization } from "./plane.ts";

/**
 * `hex(sha256(organization bytes ":" scope ":" key))`, the organization as
 * its 16 bytes: stable across attempts, so a downstream that saw the first
 * attempt's effect applies a re-drive's once; distinct across tenants sharing
 * one vendor account. The Rust client's `vendor_key` derives the same key
 * (both are checked against `tests/vectors/keys.json`).
 */
export async function vendorKey(organizationId: string, scope: string, key: string): Promise<string> {
  const hex = checkOrganization(organizationId).replaceAll("-", "");
  const organization = new Uint8Array(16);
  for (let i = 0; i < 16; i++) organization[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  const rest = new TextEncoder().encode(`:${scope}:${key}`);
  const bytes = new Uint8Array(16 + rest.length);
  bytes.set(organization);
  bytes.set(rest, 16);
  return await sha256HexOfBytes(bytes);
}
