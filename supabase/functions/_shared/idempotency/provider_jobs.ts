// The `agent.provider_jobs` directory: the jobs this platform started at a
// provider, by which a provider's callback finds its tenant before the
// webhook gate claims it (`WebhookGate.handleProviderCallback`). The Rust
// client's `ProviderJobs`, call for call.

import { PlaneError } from "./errors.ts";
import type { IdempotencyPlane } from "./plane.ts";

/** A provider job: which tenant a vendor's job belongs to. */
export interface ProviderJob {
  organizationId: string;
  provider: string;
  jobId: string;
}

/**
 * Records a job this platform started at `provider` (1 to 64 characters of
 * a-z, 0-9, `_` and `-`), `jobId` (1 to 512 characters) as the provider
 * names it. A repeat answers the stored job; the same job id under another
 * organization is refused (a `PlaneError`, code 23505).
 */
export async function registerProviderJob(
  plane: IdempotencyPlane,
  job: ProviderJob,
): Promise<ProviderJob> {
  const data = await plane.client.rpc("provider_job_register", {
    p_organization_id: job.organizationId,
    p_provider: job.provider,
    p_job_id: job.jobId,
  });
  const rows = jobRows("provider_job_register", data);
  if (rows.length !== 1) {
    throw new PlaneError("decode", `provider_job_register must answer exactly one row, answered ${rows.length}`);
  }
  return rows[0];
}

/**
 * The job `provider` knows as `jobId`, if this platform holds it. A provider
 * or job id out of shape is refused by the plane (a `PlaneError`).
 */
export async function lookupProviderJob(
  plane: IdempotencyPlane,
  provider: string,
  jobId: string,
  options: { deadlineMs?: number } = {},
): Promise<ProviderJob | undefined> {
  const data = await plane.client.rpc("provider_job_lookup", { p_provider: provider, p_job_id: jobId }, options);
  const rows = jobRows("provider_job_lookup", data);
  if (rows.length > 1) {
    throw new PlaneError("decode", `provider_job_lookup answered ${rows.length} rows, at most 1 expected`);
  }
  return rows[0];
}

/** The rows a provider-job function answered, each checked to be one. */
function jobRows(fn: string, data: unknown): ProviderJob[] {
  if (!Array.isArray(data)) throw new PlaneError("decode", `${fn} answered something other than rows`);
  return data.map((row: Record<string, unknown> | null) => {
    if (
      row === null || typeof row !== "object" || typeof row.organization_id !== "string" ||
      typeof row.provider !== "string" || typeof row.job_id !== "string"
    ) {
      throw new PlaneError("decode", `${fn}: a row without organization_id, provider or job_id`);
    }
    return { organizationId: row.organization_id, provider: row.provider, jobId: row.job_id };
  });
}
