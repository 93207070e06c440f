//! Time on the command line: parsing `--run-at`, `--after`, `--before`
//! (RFC 3339 with any offset, or relative to now) and printing
//! `google.protobuf.Timestamp` as RFC 3339 or durations for people.

use std::time::{Duration, SystemTime};

/// Parses a point in time given on the command line:
///
/// - RFC 3339: `2025-01-31T12:00:00Z`, `2025-01-31T14:00:00+02:00`,
///   fractional seconds allowed, a space instead of `T` allowed; without a
///   zone the time is UTC;
/// - `now`;
/// - `+DURATION` (from now), e.g. `+10m`, `+1h 30m`;
/// - `DURATION ago`, e.g. `2h ago`.
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
    if s.eq_ignore_ascii_case("now") {
        return Ok(SystemTime::now());
    }
    if let Some(rest) = s.strip_prefix('+') {
        let d = humantime::parse_duration(rest.trim()).map_err(|_| bad())?;
        return Ok(SystemTime::now() + d);
    }
    if let Some(rest) = s.strip_suffix("ago") {
        let d = humantime::parse_duration(rest.trim()).map_err(|_| bad())?;
        return SystemTime::now().checked_sub(d).ok_or_else(bad);
    }
    // A numeric offset after the time of day: `...T14:00:00+02:00`.
    let (base, offset_secs) = match split_offset(s) {
        Some((base, off)) => (base, off),
        None => (s, 0),
    };
    let base = base.strip_suffix(['Z', 'z']).unwrap_or(base);
    let t = humantime::parse_rfc3339_weak(base).map_err(|_| bad())?;
    let shifted = if offset_secs >= 0 {
        t.checked_sub(Duration::from_secs(offset_secs.unsigned_abs()))
    } else {
        t.checked_add(Duration::from_secs(offset_secs.unsigned_abs()))
    };
    shifted.ok_or_else(bad)
}

/// Splits `±HH:MM` (or `±HHMM`) off the end of an RFC 3339 time; returns
/// the rest and the offset east of UTC in seconds.
fn split_offset(s: &str) -> Option<(&str, i64)> {
    // The offset can only follow a time of day: "YYYY-MM-DDTHH:MM" is 16 bytes.
    for len in [6, 5] {
        if s.len() < 16 + len || !s.is_char_boundary(s.len() - len) {
            continue;
        }
        let (base, off) = s.split_at(s.len() - len);
        let sign = match off.as_bytes()[0] {
            b'+' => 1,
            b'-' => -1,
            _ => continue,
        };
        let digits: String = off[1..].chars().filter(|c| *c != ':').collect();
        if digits.len() != 4 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if len == 6 && off.as_bytes()[3] != b':' {
            continue;
        }
        let hours: i64 = digits[..2].parse().ok()?;
        let minutes: i64 = digits[2..].parse().ok()?;
        if hours > 23 || minutes > 59 {
            return None;
        }
        return Some((base, sign * (hours * 3600 + minutes * 60)));
    }
    None
}

/// A protobuf timestamp of `t`.
pub fn to_timestamp(t: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(t)
}

/// RFC 3339 text (UTC, millisecond precision) of a protobuf timestamp;
/// `None` when unset or out of range.
pub fn rfc3339(ts: Option<&prost_types::Timestamp>) -> Option<String> {
    let t = SystemTime::try_from(*ts?).ok()?;
    Some(humantime::format_rfc3339_millis(t).to_string())
}

/// RFC 3339 text (UTC, whole seconds) for tables; `-` when unset.
pub fn rfc3339_short(ts: Option<&prost_types::Timestamp>) -> String {
    ts.and_then(|ts| SystemTime::try_from(*ts).ok())
        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
        .unwrap_or_else(|| "-".into())
}

/// How long ago a timestamp was, for people ("3s ago"); `-` when unset.
pub fn ago(ts: Option<&prost_types::Timestamp>) -> String {
    let Some(t) = ts.and_then(|ts| SystemTime::try_from(*ts).ok()) else {
        return "-".into();
    };
    match SystemTime::now().duration_since(t) {
        Ok(d) => {
            let s = d.as_secs();
            match s {
                0..60 => format!("{s}s ago"),
                60..3600 => format!("{}m{:02}s ago", s / 60, s % 60),
                _ => format!("{}h{:02}m ago", s / 3600, (s % 3600) / 60),
            }
        }
        Err(_) => "just now".into(),
    }
}

/// A duration for people: `850ms`, `1.25s`, `2m05s`, `1h02m`.
pub fn human_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.2}s", d.as_secs_f64())
    } else if ms < 3_600_000 {
        let s = d.as_secs();
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        let s = d.as_secs();
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
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
        let frac = parse_time("2025-01-31T12:00:00.250Z").unwrap();
        assert_eq!(frac.duration_since(z).unwrap(), Duration::from_millis(250));
    }

    #[test]
    fn parses_relative_times() {
        let now = SystemTime::now();
        let later = parse_time("+10m").unwrap();
        assert!(later.duration_since(now).unwrap() >= Duration::from_secs(599));
        let earlier = parse_time("2h ago").unwrap();
        assert!(now.duration_since(earlier).unwrap() >= Duration::from_secs(7199));
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
        ] {
            assert!(parse_time(s).is_err(), "{s}");
        }
    }

    #[test]
    fn formats_durations() {
        assert_eq!(human_duration(Duration::from_millis(850)), "850ms");
        assert_eq!(human_duration(Duration::from_millis(1250)), "1.25s");
        assert_eq!(human_duration(Duration::from_secs(125)), "2m05s");
        assert_eq!(human_duration(Duration::from_secs(3720)), "1h02m");
    }

    #[test]
    fn formats_timestamps() {
        let ts = prost_types::Timestamp {
            seconds: 1_738_324_800,
            nanos: 5_000_000,
        };
        assert_eq!(rfc3339(Some(&ts)).unwrap(), "2025-01-31T12:00:00.005Z");
        assert_eq!(rfc3339_short(Some(&ts)), "2025-01-31T12:00:00Z");
        assert_eq!(rfc3339(None), None);
    }
}
