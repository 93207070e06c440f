//! Cron expressions of recurring schedules, read in an IANA time zone
//! (the `jiff-cron` crate, on jiff's time zone database: the system's
//! `/usr/share/zoneinfo`).
//!
//! The accepted form has a seconds field: `sec min hour day-of-month month
//! day-of-week [year]`, its days of the week numbered 1 (Sunday) to 7
//! (Saturday); a classic five-field expression (`min hour dom month dow`)
//! is read with seconds 0 and its days of the week numbered as in
//! crontab(5), 0 or 7 Sunday, 1 Monday to 6 Saturday (`0 9 * * 1-5` is
//! weekdays). Fields take numbers, ranges, lists, steps and month or day
//! names (`0 30 9 * * Mon-Fri`, `*/10 * * * * *`). Unlike crontab(5), a
//! restricted day of month and day of week must both match.

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
            5 => {
                let f: Vec<&str> = expr.split_whitespace().collect();
                let dow = crontab_days_of_week(f[4])
                    .map_err(|why| Error::invalid(format!("cron {expr:?}: {why}")))?;
                format!("0 {} {} {} {} {dow}", f[0], f[1], f[2], f[3])
            }
            6 | 7 => expr.to_string(),
            n => {
                return Err(Error::invalid(format!(
                    "cron {expr:?} has {n} fields; expected 6 or 7 (sec min hour day-of-month \
                     month day-of-week [year]) or the classic 5"
                )))
            }
        };
        // The crate's error only repeats the expression: name the field.
        let schedule = jiff_cron::Schedule::from_str(&full)
            .map_err(|_| Error::invalid(format!("cron {expr:?}: {}", field_at_fault(&full))))?;
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

    /// The time zone's name as the time zone database spells it
    /// (`europe/paris` reads as `Europe/Paris`; `UTC` for a schedule given
    /// none).
    pub fn zone_name(&self) -> &str {
        self.tz.iana_name().unwrap_or("")
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
    ///
    /// Walking back from `to_ms`, a wall-clock time that occurs twice (a
    /// night the clocks go back) is met at its earlier occurrence, while
    /// [`Self::next_after_ms`], which stored the due time, gives the
    /// later one: a range that starts at that later occurrence would lose
    /// the tick. The first tick at or after `from_ms`, walking forward, is
    /// therefore always counted.
    pub fn ticks_between(&self, from_ms: i64, to_ms: i64, max: usize) -> (Vec<i64>, bool) {
        let (mut ticks, mut more) = self.ticks_back(from_ms, to_ms, max);
        if let Some(first) = self
            .next_after_ms(from_ms.saturating_sub(1))
            .filter(|&t| t <= to_ms && ticks.first().is_none_or(|&f| t < f))
        {
            if ticks.len() < max {
                ticks.insert(0, first);
            } else {
                more = true;
            }
        }
        (ticks, more)
    }

    /// [`Self::ticks_between`] as the walk back from `to_ms` finds them.
    fn ticks_back(&self, from_ms: i64, to_ms: i64, max: usize) -> (Vec<i64>, bool) {
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

/// The fields of the six- or seven-field form, in order, with what each
/// takes besides `*`, lists, ranges and steps.
const FIELDS: [(&str, &str); 7] = [
    ("second", "0-59"),
    ("minute", "0-59"),
    ("hour", "0-23"),
    ("day-of-month", "1-31 or ?"),
    ("month", "1-12 or Jan-Dec"),
    ("day-of-week", "1-7 (Sunday 1) or Sun-Sat, or ?"),
    ("year", "1970-2100"),
];

/// Why the six- or seven-field expression `full`, which does not parse,
/// is refused: its first field that does not parse with `*` in every
/// other one (as `"hour field \"5-1\" is not valid (0-23 ...)"`), or
/// that the fields do not parse together.
fn field_at_fault(full: &str) -> String {
    let fields: Vec<&str> = full.split_whitespace().collect();
    for (i, field) in fields.iter().enumerate() {
        let alone: Vec<&str> = (0..fields.len())
            .map(|j| if j == i { *field } else { "*" })
            .collect();
        if jiff_cron::Schedule::from_str(&alone.join(" ")).is_err() {
            let (name, takes) = FIELDS[i.min(FIELDS.len() - 1)];
            return format!(
                "its {name} field {field:?} is not valid ({takes}; with `*`, lists a,b, \
                 ranges a-b and steps */n or a-b/n)"
            );
        }
    }
    "its fields do not parse together".to_string()
}

/// The day-of-week field of a classic five-field expression, numbered as
/// in crontab(5) (0 or 7 Sunday, 1 Monday .. 6 Saturday), in the
/// numbering of the six-field form (1 Sunday .. 7 Saturday): each item
/// with numbers (`5`, `1-5`, `5-7`, `*/2`, `1-5/2`, `3/2`) becomes the list
/// of the days it names; `*`, `?` and items of day names are kept.
///
/// Errors: why an item is not a day-of-week item of crontab(5) (a number
/// over 7, a reversed range, a zero step, names mixed with numbers).
fn crontab_days_of_week(field: &str) -> std::result::Result<String, String> {
    let mut items = Vec::new();
    for item in field.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((r, s)) => (r, Some(s)),
            None => (item, None),
        };
        if range == "*" && step.is_none()
            || range == "?"
            || (range.contains(|c: char| c.is_ascii_alphabetic())
                && range.chars().all(|c| c.is_ascii_alphabetic() || c == '-'))
        {
            // All days, or names: the same in both numberings (a step
            // counts days, whatever their numbers).
            items.push(item.to_string());
            continue;
        }
        let day = |s: &str| match s.parse::<u32>() {
            Ok(d) if d <= 7 => Ok(d),
            _ => Err(format!(
                "day of the week {s:?} in {item:?} is not 0..=7 (0 and 7 are Sunday) or a day name \
                 (names and numbers cannot be mixed in one item)"
            )),
        };
        let (from, to) = match range.split_once('-') {
            _ if range == "*" => (0, 6),
            Some((a, b)) => (day(a)?, day(b)?),
            None if step.is_some() => (day(range)?, 7),
            None => {
                let d = day(range)?;
                (d, d)
            }
        };
        if from > to {
            return Err(format!("day-of-week range {item:?} goes backwards"));
        }
        let step = match step {
            None => 1,
            Some(s) => match s.parse::<u32>() {
                Ok(n) if n >= 1 => n,
                _ => {
                    return Err(format!(
                        "day-of-week step in {item:?} must be a number of at least 1"
                    ))
                }
            },
        };
        // A step past the range names its first day only (as in cron).
        for d in (from..=to).step_by(usize::try_from(step).unwrap_or(usize::MAX)) {
            items.push((d % 7 + 1).to_string());
        }
    }
    items.dedup();
    Ok(items.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_expression_names_the_field_at_fault() {
        for (expr, field) in [
            ("*/0 * * * * *", "second field \"*/0\""),
            ("0 0 5-1 * * *", "hour field \"5-1\""),
            ("0 0 0 * * 8", "day-of-week field \"8\""),
            ("0 0 0 L * *", "day-of-month field \"L\""),
            ("0 0 0 1 13 *", "month field \"13\""),
            ("0 0 0 1 1 * 1969", "year field \"1969\""),
            ("60 * * * *", "minute field \"60\""),
        ] {
            let err = CronSchedule::read(expr, "").unwrap_err().to_string();
            assert!(err.contains(field), "{expr}: {err}");
            assert!(err.contains(&format!("{expr:?}")), "{expr}: {err}");
        }
    }

    #[test]
    fn a_day_of_week_step_past_the_range_names_its_first_day() {
        for (field, days) in [
            ("1-5/4294967295", "2"),
            ("7/4294967290", "1"),
            ("*/4294967295", "1"),
            ("1-5/2", "2,4,6"),
            ("5/1", "6,7,1"),
        ] {
            assert_eq!(crontab_days_of_week(field).as_deref(), Ok(days), "{field}");
        }
        assert!(CronSchedule::read("0 0 * * 1-5/4294967295", "").is_ok());
    }

    #[test]
    fn ticks_in_the_time_zone() {
        // 2026-01-15T00:00:00Z: 09:30 in Paris (UTC+1) is 08:30Z.
        let t0 = 1_768_435_200_000;
        let c = CronSchedule::parse("0 30 9 * * *", "Europe/Paris").unwrap();
        assert_eq!(c.next_after_ms(t0), Some(t0 + 8 * 3_600_000 + 30 * 60_000));
        let every = CronSchedule::parse("* * * * * *", "").unwrap();
        assert_eq!(every.next_after_ms(t0), Some(t0 + 1000));
        assert_eq!(every.next_after_ms(t0 + 1), Some(t0 + 1000));
        assert_eq!(
            CronSchedule::parse("* * * * * *", "europe/PARIS")
                .unwrap()
                .zone_name(),
            "Europe/Paris"
        );
        assert_eq!(every.zone_name(), "UTC");
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
        assert_eq!(every.ticks_between(t0 + 1, t0 + 999, 10), (vec![], false));
    }

    #[test]
    fn a_catch_up_from_the_later_of_a_time_that_occurs_twice_keeps_its_tick() {
        // 01:30 in New York on 2025-11-02 occurs twice (EDT, then EST);
        // the due time stored is the later, 06:30Z. A catch-up from it to
        // the next day counts that night's tick and the next day's.
        let c = CronSchedule::parse("0 30 1 * * *", "America/New_York").unwrap();
        let due = 1_762_065_000_000; // 2025-11-02T06:30:00Z
        assert_eq!(c.next_after_ms(due - 1), Some(due));
        let next_day = due + 24 * 3_600_000; // 2025-11-03T06:30:00Z
        assert_eq!(
            c.ticks_between(due, next_day + 5 * 3_600_000, 10),
            (vec![due, next_day], false)
        );
        assert_eq!(
            c.ticks_between(due, next_day + 5 * 3_600_000, 1),
            (vec![next_day], true)
        );
        // The same day only: one tick, as before.
        assert_eq!(
            c.ticks_between(due, due + 3_600_000, 10),
            (vec![due], false)
        );
    }

    #[test]
    fn classic_days_of_the_week_are_crontabs() {
        for (field, quartz) in [
            ("1-5", "2,3,4,5,6"),
            ("0", "1"),
            ("7", "1"),
            ("5-7", "6,7,1"),
            ("*/2", "1,3,5,7"),
            ("1/3", "2,5,1"),
            ("*", "*"),
            ("Mon-Fri", "Mon-Fri"),
            ("Mon,3", "Mon,4"),
        ] {
            assert_eq!(
                crontab_days_of_week(field).as_deref(),
                Ok(quartz),
                "{field}"
            );
        }
        for bad in ["8", "3-1", "1/0", "Mon-5", "", "1-"] {
            assert!(crontab_days_of_week(bad).is_err(), "{bad}");
        }
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
