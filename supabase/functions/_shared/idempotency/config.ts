// What the Idempotency-Key middleware is configured with: its options as
// `withIdempotencyKey` (http.ts) checked them and filled in their defaults,
// shared by every request it serves (the Rust layer's config.rs).

import type { IdempotencyPlane } from "./plane.ts";
import type { Logger } from "./log.ts";
import type { Timing } from "./timing.ts";
import type { EffectDriver } from "./driver.ts";

/** A Fetch-style handler. */
export type Handler = (req: Request) => Promise<Response> | Response;

/** A value of the request, or a function of it (sync or async). */
export type OfRequest<T> = (req: Request) => T | undefined | Promise<T | undefined>;

/** The middleware's settings, checked: what each request is served with. */
export interface Config {
  plane: IdempotencyPlane;
  driver: EffectDriver;
  timing: Timing;
  organizationId: string | OfRequest<string>;
  /** Whose keys a key is among: each caller's own, the tenant's, or not said (every keyed request is 500). */
  callers: { kind: "unchosen" } | { kind: "each"; principal: OfRequest<string> } | { kind: "shared" };
  route: string | ((req: Request) => string | undefined);
  methods: readonly string[];
  optional: boolean;
  bodyLimit: number;
  responseBodyLimit: number;
  /** Request headers in the fingerprint, lower case. */
  counted: readonly string[];
  /** Answer headers journaled and replayed, lower case. */
  kept: readonly string[];
  oversize: "omit_body" | "refuse";
  failOpen: boolean;
  log: Logger;
}
