// A tenant router: several planes (Supabase projects), each organization on
// exactly one. Every claim's unique key starts with its organization, and
// every call names it (complete and release through `claim.organizationId`),
// so each call goes to exactly one plane and an organization's journal is
// all on one. Nothing is decided across planes: each keeps its own SQL, its
// own clock and its own journal.
//
// An organization must not move to another plane while it has claims in
// retention: its next call would miss its journal there, and a replay would
// run its effect again. To move one, stop its traffic and wait out its longest
// retention (30 days for tool scopes), or copy its rows to the new plane
// before routing it there.

import { PlaneError } from "./errors.ts";
import {
  type CallOptions,
  checkOrganization,
  type Claim,
  type ClaimOutcome,
  type Completion,
  type Ending,
  type IdempotencyPlane,
  type ReadOutcome,
} from "./plane.ts";

/** What a router is built from: named planes, assignments and a default. */
export interface RouterOptions {
  /** Every plane with its name (an array of pairs, or a Map); `planes()` answers them in this order. */
  planes: Iterable<readonly [name: string, plane: IdempotencyPlane]>;
  /** Organization id → plane name (pairs, a Map, or `Object.entries` of a record). */
  assignments?: Iterable<readonly [organizationId: string, plane: string]>;
  /** The plane of every organization not assigned; without one, such an organization is refused. */
  defaultPlane?: string;
}

/**
 * Routes each call to the plane its organization is assigned to, with the
 * same operations as `IdempotencyPlane`, so a caller takes either. An
 * organization with no assignment goes to the default plane, if there is
 * one; otherwise every call for it throws `invalid_input` with reason
 * `unrouted_organization`, and nothing is sent to any plane. What takes one
 * plane (`EffectDriver`, `idempotent`, `withIdempotencyKey`) takes
 * `planeFor(organizationId)`.
 *
 * The assignments are fixed at construction: an organization never moves
 * between planes while it has claims in retention. Retention is each
 * plane's: a sweeper runs one bounded pass per plane over `planes()`.
 */
export class TenantRouter {
  readonly #planes: ReadonlyMap<string, IdempotencyPlane>;
  readonly #assignments: ReadonlyMap<string, IdempotencyPlane>;
  readonly #default?: IdempotencyPlane;

  /**
   * Refuses (`invalid_input`, reason `bad_configuration`) a router with no
   * plane or two planes of one name, an assignment or a default naming a
   * plane it does not have, and an organization assigned to two planes (ids
   * that differ only in case are one organization). An organization id that
   * is not a UUID is `malformed_organization`.
   */
  constructor(options: RouterOptions) {
    const bad = (message: string) => PlaneError.invalid("bad_configuration", message);
    const planes = new Map<string, IdempotencyPlane>();
    for (const [name, plane] of options.planes) {
      if (planes.has(name)) throw bad(`two planes are named ${JSON.stringify(name)}`);
      planes.set(name, plane);
    }
    if (planes.size === 0) throw bad("the tenant router has no plane");
    const named = (name: string): IdempotencyPlane => {
      const plane = planes.get(name);
      if (!plane) throw bad(`no plane is named ${JSON.stringify(name)}`);
      return plane;
    };
    const assignedTo = new Map<string, string>();
    for (const [organizationId, name] of options.assignments ?? []) {
      named(name);
      const id = checkOrganization(organizationId);
      const first = assignedTo.get(id);
      if (first !== undefined && first !== name) {
        throw bad(
          `organization ${id} is assigned to both plane ${JSON.stringify(first)} and plane ${JSON.stringify(name)}`,
        );
      }
      assignedTo.set(id, name);
    }
    this.#planes = planes;
    this.#assignments = new Map([...assignedTo].map(([id, name]) => [id, named(name)]));
    this.#default = options.defaultPlane === undefined ? undefined : named(options.defaultPlane);
  }

  /**
   * The plane `organizationId` is routed to: its assignment, else the
   * default. Throws `invalid_input` (`malformed_organization` for an id that
   * is not a UUID, `unrouted_organization` when it has no plane).
   */
  planeFor(organizationId: string): IdempotencyPlane {
    const id = checkOrganization(organizationId);
    const plane = this.#assignments.get(id) ?? this.#default;
    if (!plane) {
      throw PlaneError.invalid(
        "unrouted_organization",
        `organization ${id} is assigned to no plane, and the tenant router has no default plane`,
      );
    }
    return plane;
  }

  /** Every plane with its name, in the order given: what a sweeper sweeps, one pass per plane. */
  planes(): [name: string, plane: IdempotencyPlane][] {
    return [...this.#planes];
  }

  /** `IdempotencyPlane.claim`, on the organization's plane. */
  async claim(
    request: Parameters<IdempotencyPlane["claim"]>[0],
    call: CallOptions = {},
  ): Promise<ClaimOutcome> {
    return await this.planeFor(request.organizationId).claim(request, call);
  }

  /** `IdempotencyPlane.complete`, on the plane of `claim.organizationId`, the one that made the claim. */
  async complete(claim: Claim, completion: Completion, call: CallOptions = {}): Promise<Ending> {
    return await this.planeFor(claim.organizationId).complete(claim, completion, call);
  }

  /** `IdempotencyPlane.release`, on the plane of `claim.organizationId`, the one that made the claim. */
  async release(claim: Claim, call: CallOptions = {}): Promise<Ending> {
    return await this.planeFor(claim.organizationId).release(claim, call);
  }

  /** `IdempotencyPlane.read`, on the organization's plane. */
  async read(request: Parameters<IdempotencyPlane["read"]>[0], call: CallOptions = {}): Promise<ReadOutcome> {
    return await this.planeFor(request.organizationId).read(request, call);
  }
}
