//! Cron expressions of recurring schedules, read in an IANA time zone
//! (the `jiff-cron` crate, on jiff's time zone database: the system's
//! `/usr/share/zoneinfo`).
//!
//! The accepted form has a seconds field: `sec min hour day-of-month month
//! day-of-week [year]`; a classic five-field expression (`min hour dom
//! month dow`) is read with seconds 0. Fields take numbers, ranges, lists,
//! steps and month or day names (`0 30 9 * * Mon-Fri`, `*/10 * * * * *`).

use std::str::FromStr;

use jiff_cron::jiff::{tz::TimeZone, Timestamp};

use crate::error::{Error, Result};

/// Longest cron expression accepted, in bytes.
pub const MAX_CRON_BYTES: usize = 256;

/// A parsed cron expression in its time zone.
#[derive(Debug, Clone)]
pub struct CronSchedule {
    schedule: jiff_cron::Schedule,
    tz: TimeZone,
}

impl CronSchedule {
    /// Parses a new schedule's `expr` in time zone `time_zone` (IANA
    /// name; empty: UTC): [`CronSchedule::read`], and the expression must
    /// still fire after now.
    ///
    /// Errors: `InvalidArgument` naming the expression or the zone, or
    /// saying that it never fires again.
    pub fn parse(expr: &str, time_zone: &str) -> Result<CronSchedule> {
        let c = Self::read(expr, time_zone)?;
        if c.next_after_ms(crate::time::now_ms()).is_none() {
            return Err(Error::invalid(format!("cron {expr:?} never fires again")));
        }
        Ok(c)
    }

    /// Parses `expr` in time zone `time_zone` (IANA name; empty: UTC)
    /// whether or not it fires again: a stored schedule's expression,
    /// whose due ticks still fire after its last one has passed.
    ///
    /// Errors: `InvalidArgument` naming the expression or the zone.
    pub fn read(expr: &str, time_zone: &str) -> Result<CronSchedule> {
        if expr.len() > MAX_CRON_BYTES || expr.chars().any(|c| !c.is_ascii_graphic() && c != ' ') {
            return Err(Error::invalid(format!(
                "cron must be at most {MAX_CRON_BYTES} bytes of printable ASCII"
            )));
        }
        let fields = expr.split_whitespace().count();
        let full = match fields {
            5 => format!("0 {expr}"),
            6 | 7 => expr.to_string(),
            n => {
                return Err(Error::invalid(format!(
                    "cron {expr:?} has {n} fields; expected 6 or 7 (sec min hour day-of-month \
                     month day-of-week [year]) or the classic 5"
                )))
            }
        };
        let schedule = jiff_cron::Schedule::from_str(&full)
            .map_err(|e| Error::invalid(format!("cron {expr:?}: {e}")))?;
        let tz = if time_zone.is_empty() {
            TimeZone::UTC
        } else {
            if time_zone.len() > 64 {
                return Err(Error::invalid("time_zone is at most 64 bytes"));
            }
            TimeZone::get(time_zone).map_err(|e| {
                Error::invalid(format!(
                    "time_zone {time_zone:?} is not a known IANA zone: {e}"
                ))
            })?
        };
        Ok(CronSchedule { schedule, tz })
    }

    /// The first tick strictly after `after_ms` (ms since the epoch), in
    /// ms; `None` when there is none (a past year, say).
    pub fn next_after_ms(&self, after_ms: i64) -> Option<i64> {
        let after = Timestamp::from_millisecond(after_ms)
            .ok()?
            .to_zoned(self.tz.clone());
        let next = self.schedule.after(after).next()?;
        Some(next.timestamp().as_millisecond())
    }

    /// The ticks in `from_ms..=to_ms` (ms), the `max` most recent of them
    /// in ascending order, and whether older ones were left out.
    pub fn ticks_between(&self, from_ms: i64, to_ms: i64, max: usize) -> (Vec<i64>, bool) {
        let Ok(end) = Timestamp::from_millisecond(to_ms.saturating_add(1)) else {
            return (Vec::new(), false);
        };
        let mut back = self.schedule.after(end.to_zoned(self.tz.clone()));
        let mut ticks = Vec::new();
        let mut more = false;
        while let Some(t) = back.next_back() {
            let ms = t.timestamp().as_millisecond();
            if ms < from_ms {
                break;
            }
            if ticks.len() == max {
                more = true;
                break;
            }
            ticks.push(ms);
        }
        ticks.reverse();
        (ticks, more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_in_the_time_zone() {
        // 2026-01-15T00:00:00Z: 09:30 in Paris (UTC+1) is 08:30Z.
        let t0 = 1_768_435_200_000;
        let c = CronSchedule::parse("0 30 9 * * *", "Europe/Paris").unwrap();
        assert_eq!(c.next_after_ms(t0), Some(t0 + 8 * 3_600_000 + 30 * 60_000));
        let every = CronSchedule::parse("* * * * * *", "").unwrap();
        assert_eq!(every.next_after_ms(t0), Some(t0 + 1000));
        assert_eq!(every.next_after_ms(t0 + 1), Some(t0 + 1000));
        let classic = CronSchedule::parse("*/15 * * * *", "UTC").unwrap();
        assert_eq!(classic.next_after_ms(t0), Some(t0 + 15 * 60_000));
        assert_eq!(
            every.ticks_between(t0, t0 + 3000, 10),
            (vec![t0, t0 + 1000, t0 + 2000, t0 + 3000], false)
        );
        assert_eq!(
            every.ticks_between(t0 + 1, t0 + 3500, 2),
            (vec![t0 + 2000, t0 + 3000], true)
        );
    }

    #[test]
    fn refuses_bad_expressions_and_zones() {
        for (expr, tz) in [
            ("* * *", ""),
            ("61 * * * * *", ""),
            ("* * * * * * * *", ""),
            ("* * * * * *", "Mars/Olympus"),
            ("0 0 0 1 1 * 2001", ""),
        ] {
            assert!(
                matches!(
                    CronSchedule::parse(expr, tz),
                    Err(Error::InvalidArgument(_))
                ),
                "{expr} {tz}"
            );
        }
    }
}
