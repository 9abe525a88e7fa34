// The idempotency plane for Supabase Edge Functions (and any runtime with
// fetch and crypto.subtle: Deno 2, Node 20+, Cloudflare Workers). No build
// step and no dependency: import this file.
//
//   import { IdempotencyPlane, idempotent, success } from "../_shared/idempotency/mod.ts";
//   const plane = IdempotencyPlane.fromEnv(Deno.env.get);
//
// The plane itself (the SQL functions in schema `agent`) holds every
// guarantee; this client checks input, mints lease tokens, retries only what
// the shared retry-safety table (rpc_policy.json) allows, and ends every
// effect in one of three ways (driver.ts claims, held.ts ends).

export { codes, PlaneError } from "./errors.ts";
export type { InvalidReason, PlaneErrorKind, TransportFailure } from "./errors.ts";
export {
  DEFAULT_DEADLINE_MS,
  DEFAULT_RETRY,
  FetchTransport,
  PLANE_SCHEMA,
  PlaneClient,
  repeatSafe,
  SupabaseTransport,
} from "./client.ts";
export type { ClientOptions, ConnectOptions, RetryConfig, Sent, SupabaseLike, Transport } from "./client.ts";
export { canonicalize, isRequestHash, requestHash, sha256Hex, sha256HexOfBytes } from "./hash.ts";
export {
  answerFromStored,
  elidedOf,
  failure,
  MAX_RESPONSE_DEPTH,
  MAX_STORED_ERROR_BYTES,
  responseRefOf,
  store,
  success,
} from "./answer.ts";
export type { Answer, Elided, ResourceRef, ResponseRef, StoredAnswer } from "./answer.ts";
export {
  DEFAULT_MAX_ROWS,
  DEFAULT_RESPONSE_LIMIT_BYTES,
  IdempotencyPlane,
  MAX_KEY_CHARS,
  MAX_LEASE_MS,
  MAX_SCOPE_CHARS,
  MIN_LEASE_MS,
} from "./plane.ts";
export type {
  CallOptions,
  Claim,
  ClaimOutcome,
  Completion,
  Ending,
  PlaneOptions,
  PlaneSource,
  ReadOutcome,
  Redriven,
} from "./plane.ts";
export { TenantRouter } from "./router.ts";
export {
  callerAuthorized,
  MIN_ROUTE_SECRET_CHARS,
  type RedriveCounts,
  redriveRoute,
  type RedriveRouteOptions,
  ROUTE_SECRET_VARIABLE,
  routeCredentials,
  sameText,
} from "./route.ts";
export {
  authHeaders,
  type ChosenKey,
  DEFAULT_SECRET_KEY_NAME,
  type KeyKind,
  keyKind,
  SECRET_KEY_NAME_VARIABLE,
  SERVICE_KEY_VARIABLES,
  serviceKeyFromEnv,
  serviceKeysInEnv,
} from "./service_key.ts";
export type { RouterOptions } from "./router.ts";
export {
  DEFAULT_JOURNAL_DEADLINE_MS,
  DEFAULT_MARGIN_MS,
  MIN_HEARTBEAT_LEASE_MS,
  MIN_MARGIN_MS,
  RetryHorizon,
  Timing,
} from "./timing.ts";
export { monotonicNow } from "./clock.ts";
export { Held, LATE_JOURNAL_RESERVE_MS } from "./held.ts";
export type { Beat, Cut, Settle, Settled } from "./held.ts";
export { Attempt, EffectDriver } from "./driver.ts";
export type { Begun, EffectSpec } from "./driver.ts";
export { beginMany, driveMany, endingName, isDone, settleMany } from "./batch.ts";
export type { BatchItem, BatchReport, BatchSpec, ItemEnding } from "./batch.ts";
export { QueueConsumer, Queues, QUEUES_SCHEMA } from "./queue.ts";
export type {
  ConsumerOptions,
  Drained,
  MessageContext,
  QueueMessage,
  QueuePath,
  ResolvedConsumerOptions,
} from "./queue.ts";
export { queueExtend, queueSettle, queueTake } from "./queue_plane.ts";
export type { QueueClaim, QueueEnding, QueueSettled, QueueTake, TakenItem, TakeOutcome } from "./queue_plane.ts";
export { idempotent, makeIdempotent } from "./idempotent.ts";
export type { IdempotentOptions, IdempotentResult } from "./idempotent.ts";
export { NothingHappened, runAndEnd } from "./run_effect.ts";
export type { EffectContext, EffectEnded, NoAnswer } from "./run_effect.ts";
export { vendorKey } from "./vendor_key.ts";
export { DEFAULT_TOOL_LEASE_MARGIN_MS, LEASE_MARGIN_RANGE_MS, STEP_BUDGET_MS, ToolGuard, toolSpec } from "./tool.ts";
export type {
  Checkpoint,
  Reconciler,
  RepeatSafety,
  ToolCall,
  ToolGuardOptions,
  ToolInvocation,
  ToolRun,
  ToolSpec,
} from "./tool.ts";
export { ToolError } from "./tool_error.ts";
export type { ToolErrorKind } from "./tool_error.ts";
export { isToolKey, toolCallKey, toolKey } from "./tool_key.ts";
export type { ToolKey } from "./tool_key.ts";
export { consoleLogger, silent } from "./log.ts";
export {
  errorKind,
  INSTRUMENTATION_SCOPE,
  keyHash,
  METRIC_KINDS,
  METRICS,
  spanContextOf,
  Telemetry,
  traceparentOf,
} from "./telemetry.ts";
export type {
  MetricKind,
  MetricName,
  OtelContext,
  OtelMeter,
  OtelSpan,
  OtelSpanContext,
  OtelTracer,
  SpanScope,
  SpanStart,
  TelemetryApi,
  TelemetryValue,
} from "./telemetry.ts";
export type { Logger, PlaneEvent } from "./log.ts";
export {
  bodyOf,
  DEFAULT_GATE_DEADLINE_MS,
  DEFAULT_PROCESSING_TIMEOUT_MS,
  DEFAULT_VENDOR_HORIZON_MS,
  DEFAULT_WEBHOOK_BODY_LIMIT_BYTES,
  FAILED_ACK_ERROR_CHARS,
  largestStorableBody,
  ProcessingError,
  storedBody,
  storedBodyBound,
  WEBHOOK_LEASE_MARGIN_MS,
  WEBHOOK_SCOPE_MAX_REQUEST_BYTES,
  WebhookGate,
  webhookHandler,
} from "./webhook.ts";
export type {
  Ack,
  Delivery,
  DropReason,
  GateOptions,
  ProviderCallback,
  ProviderJob,
  Redelivery,
  RedriveReport,
  WebhookRoute,
} from "./webhook.ts";
export { lookupProviderJob, registerProviderJob } from "./provider_jobs.ts";
export { CREDENTIAL_HEADERS } from "./stored_response.ts";
export { IDEMPOTENCY_KEY, idempotencyKey, MAX_IDEMPOTENCY_KEY_CHARS, planeKey, targetOf } from "./key.ts";
export type { Handler } from "./config.ts";
export { withIdempotencyKey } from "./http.ts";
export type { IdempotencyKeyOptions } from "./http.ts";
export { fingerprint, scopeOf } from "./fingerprint.ts";
export { PROBLEM_TYPE_BASE, PROBLEM_TYPES, problemResponse } from "./problem.ts";
export type { Problem, ProblemSlug } from "./problem.ts";
