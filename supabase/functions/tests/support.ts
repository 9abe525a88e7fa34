// What the tests share: the plane under test (a real `idem up`, from the
// env its runner exports), fetch wrappers that lose or delay answers after
// the server acted on them, and small helpers.

import { IdempotencyPlane, type PlaneOptions, requestHash } from "../_shared/idempotency/mod.ts";

export const URL_ = Deno.env.get("IDEM_POSTGREST_URL") ?? "";
export const KEY = Deno.env.get("IDEM_SERVICE_KEY") ?? "";
if (!URL_ || !KEY) {
  throw new Error("set IDEM_POSTGREST_URL and IDEM_SERVICE_KEY (supabase/functions/tests/run.sh does, from `idem up`)");
}

/** A fresh tenant per test, so tests never meet each other's keys. */
export function organization(): string {
  return crypto.randomUUID();
}

export function uniqueKey(prefix = "k"): string {
  return `${prefix}-${crypto.randomUUID()}`;
}

export async function hashOf(value: unknown): Promise<string> {
  return await requestHash(value);
}

/** A plane over plain fetch (or `fetch` given). */
export function plane(options: PlaneOptions & { fetch?: typeof fetch } = {}): IdempotencyPlane {
  return IdempotencyPlane.connect({ url: URL_, key: KEY, fetch: options.fetch }, options);
}

/** Which functions were called, in order. */
export function functionOf(input: RequestInfo | URL): string {
  const url = typeof input === "string" ? input : input instanceof URL ? input.href : input.url;
  return url.slice(url.lastIndexOf("/") + 1);
}

/**
 * A fetch that, for the next `count` calls of `fn`, lets the server act and
 * then loses its answer (a reset after the commit); every call is recorded.
 */
export class Lossy {
  readonly calls: string[] = [];
  #losses = new Map<string, number>();
  #delays = new Map<string, number>();
  #refuse = false;

  loseNext(fn: string, count = 1): this {
    this.#losses.set(fn, (this.#losses.get(fn) ?? 0) + count);
    return this;
  }

  /** Delays every answer of `fn` by `ms`, after the server acted. */
  delay(fn: string, ms: number): this {
    this.#delays.set(fn, ms);
    return this;
  }

  /** Every request fails before it leaves (a refused connection). */
  refuseAll(refuse = true): this {
    this.#refuse = refuse;
    return this;
  }

  readonly fetch: typeof fetch = async (input, init) => {
    const fn = functionOf(input);
    this.calls.push(fn);
    if (this.#refuse) throw new TypeError("error sending request: Connection refused (os error 111)");
    const response = await fetch(input, init);
    const body = await response.arrayBuffer();
    const delay = this.#delays.get(fn);
    if (delay) {
      await new Promise<void>((resolve, reject) => {
        const timer = setTimeout(resolve, delay);
        init?.signal?.addEventListener("abort", () => {
          clearTimeout(timer);
          reject(init.signal?.reason ?? new DOMException("aborted", "AbortError"));
        });
      });
    }
    const losses = this.#losses.get(fn) ?? 0;
    if (losses > 0) {
      this.#losses.set(fn, losses - 1);
      throw new TypeError("error reading a body from connection: connection reset");
    }
    return new Response(body, { status: response.status, headers: response.headers });
  };

  count(fn: string): number {
    return this.calls.filter((call) => call === fn).length;
  }
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** Polls `check` until it is true or `ms` pass. */
export async function eventually(what: string, check: () => Promise<boolean>, ms = 10_000): Promise<void> {
  const until = performance.now() + ms;
  while (performance.now() < until) {
    if (await check()) return;
    await sleep(50);
  }
  throw new Error(`not within ${ms} ms: ${what}`);
}

export const HOUR_MS = 60 * 60_000;

const wallClock = Date.now;
let wallClockStep = 0;

/**
 * Steps the wall clock (`Date.now`) by `stepMs`, back when negative, as NTP,
 * an operator or a VM's resume does; timers and `performance.now()` run on.
 * Steps add up until `restoreWallClock` (call it in a `finally`).
 */
export function stepWallClock(stepMs: number): void {
  wallClockStep += stepMs;
  Date.now = () => wallClock() + wallClockStep;
}

export function restoreWallClock(): void {
  wallClockStep = 0;
  Date.now = wallClock;
}

/** `promise`, or a rejection saying `what` did not settle within `ms` (a bound, never a wait: it ends with the promise). */
export async function within<T>(what: string, promise: Promise<T>, ms: number): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const bound = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`not within ${ms} ms: ${what}`)), ms);
  });
  try {
    return await Promise.race([promise, bound]);
  } finally {
    clearTimeout(timer);
  }
}

/**
 * Reads `reader` until the text read so far holds `marker`, and answers that text. Rejects, naming `what`, when the
 * stream ends first or `ms` pass: a process that never prints fails its test instead of hanging it.
 */
export async function readUntil(
  reader: ReadableStreamDefaultReader<string>,
  marker: string,
  what: string,
  ms = 30_000,
): Promise<string> {
  let text = "";
  const read = async () => {
    while (!text.includes(marker)) {
      const { value, done } = await reader.read();
      if (done) throw new Error(`${what} ended before it printed ${JSON.stringify(marker)}: ${text}`);
      text += value;
    }
    return text;
  };
  try {
    return await within(`${what} printing ${JSON.stringify(marker)}`, read(), ms);
  } catch (error) {
    throw new Error(`${error instanceof Error ? error.message : String(error)}; read so far: ${JSON.stringify(text)}`);
  }
}

/** A server started as a process of its own: its URL once it printed `listening on …`. */
export interface Served {
  url: string;
  child: Deno.ChildProcess;
}

/** Starts `command` with `env` added to this environment, and answers once it printed `listening on http://HOST:PORT`. */
export async function serve(command: string, args: string[], env: Record<string, string>): Promise<Served> {
  const child = new Deno.Command(command, { args, env, stdout: "piped", stderr: "null" }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  let url: string;
  try {
    const text = await readUntil(reader, "\n", `${command} starting to serve`);
    const found = /listening on (\S+)/.exec(text)?.[1];
    if (!found) throw new Error(`no listening line: ${text}`);
    url = found;
  } catch (error) {
    await killHard(child);
    await reader.cancel().catch(() => {});
    throw error;
  }
  // Keep draining stdout so the child never blocks on a full pipe.
  (async () => {
    while (!(await reader.read().catch(() => ({ done: true }))).done);
  })();
  return { url, child };
}

/** Kills a served process with SIGKILL, as a platform stops a worker, and waits for it to be gone. */
export async function killHard(child: Deno.ChildProcess): Promise<void> {
  try {
    child.kill("SIGKILL");
  } catch {
    // Already gone.
  }
  await child.status;
}

/** `idem redrive --to <route> --json ...` against the local plane: its exit code and output. */
export async function idemRedrive(route: string, ...args: string[]) {
  return await idem("redrive", "--to", route, "--json", ...args);
}

/** The `idem` CLI (IDEM_BIN) with `args`, against the local plane: its exit code and output. */
export async function idem(...args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  const bin = Deno.env.get("IDEM_BIN");
  if (!bin) throw new Error("IDEM_BIN is not set: run this through .ci/with-local-plane.sh");
  const output = await new Deno.Command(bin, {
    args,
    env: { IDEM_POSTGREST_URL: URL_, IDEM_SERVICE_KEY: KEY },
    stdout: "piped",
    stderr: "piped",
  }).output();
  const decode = (bytes: Uint8Array) => new TextDecoder().decode(bytes);
  return { code: output.code, stdout: decode(output.stdout), stderr: decode(output.stderr) };
}

/**
 * A TCP proxy in front of the plane under test (or `target`), that can be partitioned: `partition()` stops forwarding
 * on every open connection, holding it open without passing a byte either way, and blackholes every new one (accepted,
 * never read nor answered), as a network partition does: a worker behind it sees its requests go unanswered, not a
 * clean close. `close()` ends every connection and the listener.
 */
export class PartitionProxy {
  /** The plane's URL through this proxy. */
  readonly url: string;
  readonly #listener: Deno.Listener;
  readonly #upstream: { hostname: string; port: number };
  readonly #conns = new Set<Deno.Conn>();
  readonly #work: Promise<void>[] = [];
  readonly #accepting: Promise<void>;
  #partitioned = false;

  constructor(target = URL_) {
    const upstream = new URL(target);
    this.#upstream = { hostname: upstream.hostname, port: Number(upstream.port || 80) };
    this.#listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
    const through = new URL(target);
    through.hostname = "127.0.0.1";
    through.port = String((this.#listener.addr as Deno.NetAddr).port);
    this.url = through.href.replace(/\/+$/, "");
    this.#accepting = this.#accept();
  }

  /** From now on nothing passes, either way, on any connection: each is held open, unanswered. */
  partition(): void {
    this.#partitioned = true;
  }

  get partitioned(): boolean {
    return this.#partitioned;
  }

  /** Closes every connection (a held one resets) and the listener, and waits for the forwarding to end. */
  async close(): Promise<void> {
    try {
      this.#listener.close();
    } catch {
      // Closed already.
    }
    for (const conn of this.#conns) this.#drop(conn);
    await this.#accepting;
    await Promise.allSettled(this.#work);
  }

  async #accept(): Promise<void> {
    try {
      for await (const client of this.#listener) {
        this.#conns.add(client);
        // Partitioned: accepted and held, never read nor answered.
        if (!this.#partitioned) this.#work.push(this.#forward(client));
      }
    } catch {
      // The listener was closed.
    }
  }

  async #forward(client: Deno.Conn): Promise<void> {
    let server: Deno.Conn;
    try {
      server = await Deno.connect(this.#upstream);
    } catch {
      this.#drop(client);
      return;
    }
    this.#conns.add(server);
    await Promise.all([this.#pipe(client, server), this.#pipe(server, client)]);
  }

  /** Copies `from` to `to` until either closes; once partitioned, drops what it read and stops reading. */
  async #pipe(from: Deno.Conn, to: Deno.Conn): Promise<void> {
    const buffer = new Uint8Array(16 * 1024);
    try {
      for (;;) {
        const n = await from.read(buffer);
        if (this.#partitioned) return; // held open: neither forwarded nor closed
        if (n === null) break;
        let written = 0;
        while (written < n) written += await to.write(buffer.subarray(written, n));
      }
    } catch {
      // Closed by the other direction, or by close().
    }
    if (this.#partitioned) return;
    this.#drop(from);
    this.#drop(to);
  }

  #drop(conn: Deno.Conn): void {
    this.#conns.delete(conn);
    try {
      conn.close();
    } catch {
      // Closed already.
    }
  }
}

/**
 * Runs `query` over a superuser connection to the database served (IDEM_TEST_DATABASE_URL, which
 * .ci/with-local-plane.sh exports): for what the API cannot do, such as moving a lease as a database clock step would.
 * Answers its rows, tab-separated.
 */
export async function superuserSql(query: string): Promise<string[][]> {
  const url = Deno.env.get("IDEM_TEST_DATABASE_URL");
  if (!url) throw new Error("IDEM_TEST_DATABASE_URL is not set: run this through .ci/with-local-plane.sh");
  const output = await new Deno.Command("psql", {
    args: [url, "-X", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1", "-c", query],
    stdout: "piped",
    stderr: "piped",
  }).output();
  if (output.code !== 0) throw new Error(`psql failed: ${new TextDecoder().decode(output.stderr)}`);
  return new TextDecoder().decode(output.stdout).split("\n").filter((line) => line !== "").map((line) =>
    line.split("\t")
  );
}
