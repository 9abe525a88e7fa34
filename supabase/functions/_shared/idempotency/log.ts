// Structured events: what an operator needs to answer "why did this call
// not run?" (scope, key, outcome, ending, drop reason, replayed). The plane
// never logs a lease token, a service key or a request body.

/** One event. `level` defaults to "info". */
export interface PlaneEvent {
  event: string;
  level?: "debug" | "info" | "warn" | "error";
  [field: string]: unknown;
}

/** Where events go. */
export type Logger = (event: PlaneEvent) => void;

/** Drops every event. */
export const silent: Logger = () => {};

/**
 * One JSON line per event on the console (what Supabase's function logs
 * collect), from `minimum` up: "warn" by default, so only endings that need
 * an operator's eye are written.
 */
export function consoleLogger(minimum: "debug" | "info" | "warn" | "error" = "warn"): Logger {
  const order = { debug: 0, info: 1, warn: 2, error: 3 } as const;
  return (event) => {
    const level = event.level ?? "info";
    if (order[level] < order[minimum]) return;
    const line = JSON.stringify({ ...event, level });
    if (level === "error") console.error(line);
    else if (level === "warn") console.warn(line);
    else console.log(line);
  };
}
