// Bodies the Idempotency-Key middleware buffers: a request's before its
// claim (it is part of the fingerprint, and the handler gets it again), and
// an answer's before its journal, each up to a limit, an answer's also up to
// the handler's deadline.

import { monotonicNow } from "./clock.ts";

/** A body read whole, or why not: above the limit, broken off, or not done by the deadline. */
export type Read = { bytes: Uint8Array } | { tooLarge: true } | { broke: unknown } | { late: true };

/** Reads `body` up to `limit` bytes, and until `deadline` (monotonic ms, clock.ts) when given. */
export async function readBody(
  body: ReadableStream<Uint8Array> | null,
  limit: number,
  deadline?: number,
): Promise<Read> {
  if (body === null) return { bytes: new Uint8Array(0) };
  const reader = body.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = deadline === undefined ? undefined : new Promise<{ late: true }>((resolve) => {
    timer = setTimeout(() => resolve({ late: true }), Math.max(0, deadline - monotonicNow()));
  });
  try {
    for (;;) {
      const next = reader.read().then((chunk) => ({ chunk }), (broke: unknown) => ({ broke }));
      const got = await (late ? Promise.race([next, late]) : next);
      if ("late" in got) {
        reader.cancel().catch(() => {});
        return got;
      }
      if ("broke" in got) return { broke: got.broke };
      if (got.chunk.done) break;
      size += got.chunk.value.length;
      if (size > limit) {
        reader.cancel().catch(() => {});
        return { tooLarge: true };
      }
      chunks.push(got.chunk.value);
    }
  } finally {
    clearTimeout(timer);
  }
  const bytes = new Uint8Array(size);
  let at = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, at);
    at += chunk.length;
  }
  return { bytes };
}

/**
 * The request again, with its buffered body (and a signal of its own, when
 * given), built from its URL, method and headers. Never `new Request(req, …)`:
 * that copies `req.signal`, and reading the signal of a request `Deno.serve`
 * made opts into its legacy behaviour (the signal aborts once a response is
 * sent, which would stop work still running under the claim) and prints a
 * warning on every request.
 */
export function rebuilt(req: Request, body: Uint8Array, signal?: AbortSignal): Request {
  const init: RequestInit = {
    method: req.method,
    headers: req.headers,
    body: req.method === "GET" || req.method === "HEAD" ? null : body as BodyInit,
    redirect: req.redirect,
  };
  if (signal) init.signal = signal;
  return new Request(req.url, init);
}
