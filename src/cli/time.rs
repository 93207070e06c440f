//! Time on the command line: parsing `--run-at`, `--after`, `--before`
//! (RFC 3339 with any offset, or relative to now) and printing
//! `google.protobuf.Timestamp` as RFC 3339 or durations for people. The
//! calendar work is `jiff`'s: its RFC 3339 / ISO 8601 parser, its "friendly"
//! duration parser (`10m`, `1h 30m`, `2h ago`) and span rounding.

use std::time::{Duration, SystemTime};

use jiff::{
    fmt::temporal::{Pieces, PiecesOffset},
    tz::Offset,
    SignedDuration, Span, SpanRelativeTo, SpanRound, Timestamp, Unit,
};

/// Parses a point in time given on the command line:
///
/// - RFC 3339: `2025-01-31T12:00:00Z`, `2025-01-31T14:00:00+02:00`,
///   fractional seconds allowed, a space instead of `T` allowed; without a
///   zone the time is UTC;
/// - `now`;
/// - `+DURATION` (from now), e.g. `+10m`, `+1h 30m`;
/// - `DURATION ago`, e.g. `2h ago`.
///
/// Durations are `jiff`'s friendly format (`90s`, `1h 30m`, `2 days`); a
/// day counts as 24 hours.
///
/// # Errors
///
/// A message naming the accepted forms.
pub fn parse_time(s: &str) -> Result<SystemTime, String> {
    let s = s.trim();
    let bad = || {
        format!(
            "{s:?} is not a time: use RFC 3339 (2025-01-31T12:00:00Z, \
             2025-01-31T14:00:00+02:00), now, +10m or \"2h ago\""
        )
    };
    let t = if s.eq_ignore_ascii_case("now") {
        Timestamp::now()
    } else if s.starts_with('+') || s.ends_with("ago") {
        // The friendly parser reads the sign and the `ago` suffix itself:
        // `+10m` is ten minutes ahead, `2h ago` two hours back.
        let span: Span = s.parse().map_err(|_| bad())?;
        let d = span
            .to_duration(SpanRelativeTo::days_are_24_hours())
            .map_err(|_| bad())?;
        Timestamp::now().checked_add(d).map_err(|_| bad())?
    } else {
        parse_rfc3339(s).ok_or_else(bad)?
    };
    SystemTime::try_from(t).map_err(|_| bad())
}

/// An RFC 3339 date and time; a missing offset means UTC. jiff's parser
/// also reads the RFC 9557 and ISO 8601 relatives of RFC 3339, so what
/// RFC 3339 rules out is refused here: a time zone annotation, a missing
/// time of day, an offset of 24 hours or more.
fn parse_rfc3339(s: &str) -> Option<Timestamp> {
    let pieces = Pieces::parse(s).ok()?;
    if pieces.time_zone_annotation().is_some() {
        return None;
    }
    let offset = match pieces.offset() {
        None | Some(PiecesOffset::Zulu) => Offset::UTC,
        Some(PiecesOffset::Numeric(n)) => n.offset(),
        Some(_) => return None,
    };
    if offset.seconds().abs() >= 24 * 3600 {
        return None;
    }
    let datetime = pieces.date().to_datetime(pieces.time()?);
    offset.to_timestamp(datetime).ok()
}

/// A protobuf timestamp of `t`.
pub fn to_timestamp(t: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(t)
}

/// The jiff timestamp of a protobuf timestamp; `None` when unset or out of
/// range.
fn timestamp(ts: Option<&prost_types::Timestamp>) -> Option<Timestamp> {
    let ts = ts?;
    Timestamp::new(ts.seconds, ts.nanos).ok()
}

/// RFC 3339 text (UTC, millisecond precision) of a protobuf timestamp;
/// `None` when unset or out of range.
pub fn rfc3339(ts: Option<&prost_types::Timestamp>) -> Option<String> {
    timestamp(ts).map(|t| format!("{t:.3}"))
}

/// The time from `from` to `to`; `None` when either is unset or out of
/// range, or `to` is before `from`.
pub fn between(
    from: Option<&prost_types::Timestamp>,
    to: Option<&prost_types::Timestamp>,
) -> Option<Duration> {
    let d = timestamp(to)?.duration_since(timestamp(from)?);
    Duration::try_from(d).ok()
}

/// The time now, UTC, to the second: `2025-01-31T12:00:05Z`.
pub fn now_utc() -> String {
    utc_seconds(Timestamp::now())
}

/// `t` in UTC to the second (truncated): `2025-01-31T12:00:05Z`.
pub fn utc_seconds(t: Timestamp) -> String {
    format!("{t:.0}")
}

/// How long ago a timestamp was, for people ("3s ago", "2m05s ago",
/// "1h02m ago"); `-` when unset, `just now` for a time in the future.
pub fn ago(ts: Option<&prost_types::Timestamp>) -> String {
    let Some(t) = timestamp(ts) else {
        return "-".into();
    };
    let elapsed = Timestamp::now().duration_since(t);
    if elapsed.is_negative() {
        return "just now".into();
    }
    // Truncated, not rounded: "59s ago" until a whole minute has passed.
    let d = Duration::try_from(elapsed).unwrap_or_default();
    format!("{} ago", clock(Duration::from_secs(d.as_secs())))
}

/// A duration for people: `850ms`, `1.25s`, `2m05s`, `1h02m`.
pub fn human_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else if d < Duration::from_secs(60) {
        format!("{:.2}s", d.as_secs_f64())
    } else {
        clock(d)
    }
}

/// `d` in its two largest units, hours and minutes or minutes and seconds,
/// the second unit zero-padded: `5s`, `2m05s`, `1h02m`. The units come from
/// jiff's span balancing, truncated to the smaller unit shown.
pub fn clock(d: Duration) -> String {
    let Ok(d) = SignedDuration::try_from(d) else {
        return format!("{}s", d.as_secs());
    };
    let smallest = if d < SignedDuration::from_hours(1) {
        Unit::Second
    } else {
        Unit::Minute
    };
    let span = Span::try_from(d)
        .and_then(|s| {
            s.round(
                SpanRound::new()
                    .largest(Unit::Hour)
                    .smallest(smallest)
                    .mode(jiff::RoundMode::Trunc),
            )
        })
        .unwrap_or_default();
    match (span.get_hours(), span.get_minutes()) {
        (0, 0) => format!("{}s", span.get_seconds()),
        (0, m) => format!("{m}m{:02}s", span.get_seconds()),
        (h, m) => format!("{h}h{m:02}m"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(t: SystemTime) -> u64 {
        t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs()
    }

    #[test]
    fn parses_rfc3339_with_offsets() {
        let z = parse_time("2025-01-31T12:00:00Z").unwrap();
        assert_eq!(secs(z), 1_738_324_800);
        assert_eq!(parse_time("2025-01-31T14:00:00+02:00").unwrap(), z);
        assert_eq!(parse_time("2025-01-31T07:30:00-04:30").unwrap(), z);
        assert_eq!(parse_time("2025-01-31 12:00:00").unwrap(), z);
        assert_eq!(parse_time("2025-01-31T12:00:00+0000").unwrap(), z);
        assert_eq!(parse_time("2025-01-31t12:00:00z").unwrap(), z);
        let frac = parse_time("2025-01-31T12:00:00.250Z").unwrap();
        assert_eq!(frac.duration_since(z).unwrap(), Duration::from_millis(250));
    }

    #[test]
    fn parses_relative_times() {
        let now = SystemTime::now();
        let later = parse_time("+10m").unwrap();
        assert!(later.duration_since(now).unwrap() >= Duration::from_secs(599));
        let later = parse_time("+1h 30m").unwrap();
        assert!(later.duration_since(now).unwrap() >= Duration::from_secs(5399));
        let earlier = parse_time("2h ago").unwrap();
        assert!(now.duration_since(earlier).unwrap() >= Duration::from_secs(7199));
        assert!(now.duration_since(earlier).unwrap() < Duration::from_secs(7260));
        let days = parse_time("2 days ago").unwrap();
        assert!(now.duration_since(days).unwrap() >= Duration::from_secs(2 * 86400 - 1));
        assert!(parse_time("now").is_ok());
    }

    #[test]
    fn rejects_garbage() {
        for s in [
            "",
            "tomorrow",
            "2025-13-01T00:00:00Z",
            "+",
            "12:00",
            "2025-01-31T12:00:00+25:00",
            "2025-01-31T12:00:00+24:00",
            "2025-01-31",
            "2025-01-31T12:00:00Z[Europe/Paris]",
            "10m",
            "ago",
        ] {
            assert!(parse_time(s).is_err(), "{s}");
        }
    }

    #[test]
    fn formats_durations() {
        assert_eq!(human_duration(Duration::from_millis(850)), "850ms");
        assert_eq!(human_duration(Duration::from_millis(1250)), "1.25s");
        assert_eq!(human_duration(Duration::from_secs(125)), "2m05s");
        assert_eq!(human_duration(Duration::from_millis(125_999)), "2m05s");
        assert_eq!(human_duration(Duration::from_secs(3720)), "1h02m");
        assert_eq!(human_duration(Duration::from_secs(3600 * 30)), "30h00m");
    }

    #[test]
    fn formats_ages() {
        let ago_secs = |s: i64| {
            let now = Timestamp::now().as_second();
            ago(Some(&prost_types::Timestamp {
                seconds: now - s,
                nanos: 0,
            }))
        };
        assert_eq!(ago(None), "-");
        assert_eq!(ago_secs(-60), "just now");
        assert!(ago_secs(3).ends_with("s ago"), "{}", ago_secs(3));
        assert_eq!(ago_secs(3 * 3600 + 120), "3h02m ago");
    }

    #[test]
    fn measures_between_timestamps() {
        let at = |seconds, nanos| prost_types::Timestamp { seconds, nanos };
        let d = between(Some(&at(100, 0)), Some(&at(225, 500_000_000)));
        assert_eq!(d, Some(Duration::from_millis(125_500)));
        assert_eq!(between(Some(&at(200, 0)), Some(&at(100, 0))), None);
        assert_eq!(between(None, Some(&at(100, 0))), None);
        let t = Timestamp::new(1_738_324_805, 999_000_000).unwrap();
        assert_eq!(utc_seconds(t), "2025-01-31T12:00:05Z");
    }

    #[test]
    fn formats_timestamps() {
        let ts = prost_types::Timestamp {
            seconds: 1_738_324_800,
            nanos: 5_000_000,
        };
        assert_eq!(rfc3339(Some(&ts)).unwrap(), "2025-01-31T12:00:00.005Z");
        let whole = prost_types::Timestamp {
            seconds: 1_738_324_800,
            nanos: 0,
        };
        assert_eq!(rfc3339(Some(&whole)).unwrap(), "2025-01-31T12:00:00.000Z");
        assert_eq!(rfc3339(None), None);
    }
}
