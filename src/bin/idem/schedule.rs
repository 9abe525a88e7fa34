//! `--every` and `--align`: the schedule `idem sweep` and `idem redrive`
//! run their passes on, as a standalone worker on a platform without
//! pg_cron.

use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{exit, metrics_endpoint, signal};

/// The schedule flags, flattened into a command's own.
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct ScheduleArgs {
    /// Run a pass every interval (e.g. 1h, 15m, 30s) until interrupted, for
    /// a standalone worker. Without it, one pass.
    #[arg(long, value_parser = parse_interval)]
    every: Option<Duration>,
    /// With --every: start each pass on a multiple of the interval since
    /// midnight UTC (--every 1h: on the hour), the first one included, then
    /// wait up to 10 % of the interval (at most 5 min) of random jitter, so
    /// many workers do not hit the database at the same instant. Without
    /// it, passes run back to back with ±10 % jitter, the first at once.
    #[arg(long, requires = "every")]
    align: bool,
    /// With --every: serve Prometheus metrics at http://HOST:PORT/metrics
    /// (the command's counters, per-function RPC latency, errors by kind).
    #[arg(long, value_name = "HOST:PORT", requires = "every")]
    metrics_addr: Option<SocketAddr>,
}

impl ScheduleArgs {
    /// Serves the metrics endpoint, when one was asked for.
    pub(crate) fn serve_metrics(&self) -> Result<(), crate::BoxError> {
        if let Some(addr) = self.metrics_addr {
            metrics_endpoint::serve(addr)?;
            eprintln!("metrics on http://{addr}/metrics");
        }
        Ok(())
    }

    /// The schedule asked for; `None` for a single pass.
    pub(crate) fn schedule(&self) -> Option<Schedule> {
        self.every.map(|every| Schedule { every, align: self.align })
    }
}

/// Passes every interval, until Ctrl-C or SIGTERM.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Schedule {
    every: Duration,
    align: bool,
}

impl Schedule {
    /// Runs `pass` on the schedule until a signal; answers the last pass's
    /// exit code (success when none ran). A pass that fails answers its
    /// code and the next tick comes as usual: a worker outlives a blip.
    pub(crate) async fn run<F, Fut>(self, mut pass: F) -> Result<ExitCode, crate::BoxError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = ExitCode>,
    {
        let mut shutdown = Box::pin(signal::shutdown());
        let mut last = exit::ok();
        let mut first = true;
        loop {
            let wait = if self.align {
                until_next_boundary(SystemTime::now(), self.every)
                    + aligned_jitter(self.every).mul_f64(rand::random::<f64>())
            } else if first {
                Duration::ZERO
            } else {
                self.every.mul_f64(0.9 + 0.2 * rand::random::<f64>())
            };
            first = false;
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                signal = &mut shutdown => {
                    eprintln!("{}: stopping", signal.unwrap_or("signal error"));
                    return Ok(last);
                }
            }
            last = pass().await;
        }
    }
}

/// The longest `--every`: a pass that runs less than weekly is no schedule.
const MAX_INTERVAL: Duration = Duration::from_secs(7 * 86_400);

/// From `now` to the next multiple of `every` counted from midnight UTC
/// (every day starts on a boundary, so `1h` is the top of each hour and
/// `15m` the quarter hours). Never zero: a pass that ends exactly on a
/// boundary waits for the next one.
fn until_next_boundary(now: SystemTime, every: Duration) -> Duration {
    let since_epoch = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let day = Duration::from_secs(86_400);
    // Periods that divide a day line up with the day; longer ones with the epoch.
    let period = every.as_millis().max(1);
    let base = if day.as_millis().is_multiple_of(period) { day.as_millis() } else { period };
    let into_base = since_epoch.as_millis() % base;
    let into_period = into_base % period;
    let left = period - into_period;
    Duration::from_millis(u64::try_from(left).unwrap_or(u64::MAX))
}

/// The most random delay after an aligned boundary: 10 % of the interval,
/// at most five minutes.
fn aligned_jitter(every: Duration) -> Duration {
    every.mul_f64(0.1).min(Duration::from_secs(300))
}

/// `90s`, `15m`, `1h`, `2d`, or plain seconds.
fn parse_interval(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits.parse().map_err(|_| format!("{text:?} is not an interval like 30s, 15m or 1h"))?;
    let seconds = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        other => return Err(format!("unknown unit {other:?}: use s, m, h or d")),
    };
    let interval = Duration::from_secs(number.saturating_mul(seconds));
    if interval.is_zero() || interval > MAX_INTERVAL {
        return Err("the interval must be above zero and at most 7d".into());
    }
    Ok(interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_passes_start_on_the_hour_and_on_quarter_hours() {
        let at = |secs: u64| UNIX_EPOCH + Duration::from_secs(secs);
        let hour = Duration::from_secs(3600);
        // 2026-11-30 13:59:30 UTC is 30 s before the top of the hour.
        let day_start = 1_795_996_800; // 2026-11-30 00:00:00 UTC
        assert_eq!(until_next_boundary(at(day_start + 13 * 3600 + 3570), hour), Duration::from_secs(30));
        // On the boundary itself: the next one, a whole interval away.
        assert_eq!(until_next_boundary(at(day_start + 14 * 3600), hour), hour);
        let quarter = Duration::from_secs(900);
        assert_eq!(until_next_boundary(at(day_start + 14 * 3600 + 1), quarter), Duration::from_secs(899));
        // 7 h does not divide a day: it lines up with the epoch instead, and
        // still never waits longer than one interval.
        let seven = Duration::from_secs(7 * 3600);
        let wait = until_next_boundary(at(day_start + 5), seven);
        assert!(wait > Duration::ZERO && wait <= seven, "{wait:?}");
        assert_eq!(aligned_jitter(hour), Duration::from_secs(300));
        assert_eq!(aligned_jitter(Duration::from_secs(60)), Duration::from_secs(6));
    }

    #[test]
    fn intervals_parse_with_units_and_refuse_garbage() {
        assert_eq!(parse_interval("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_interval("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_interval("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_interval("2d"), Ok(Duration::from_secs(172_800)));
        for bad in ["", "h", "0s", "1w", "-1h", "1.5h", "8d", "99999999999999d"] {
            assert!(parse_interval(bad).is_err(), "{bad}");
        }
    }
}
