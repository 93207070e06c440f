//! Conversions between milliseconds since the Unix epoch (how AGQ stores
//! time) and `google.protobuf.Timestamp` / RFC 3339 text.

use std::time::{Duration, UNIX_EPOCH};

/// A protobuf timestamp for `ms` milliseconds since the Unix epoch.
pub fn ts(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

/// Milliseconds since the Unix epoch of a protobuf timestamp, or `None` when
/// it is out of range (negative nanos, absurd seconds).
pub fn ms_of(t: &prost_types::Timestamp) -> Option<i64> {
    if !(0..1_000_000_000).contains(&t.nanos) {
        return None;
    }
    // Years 0001..=9999, as the Timestamp spec allows.
    if !(-62_135_596_800..=253_402_300_799).contains(&t.seconds) {
        return None;
    }
    Some(t.seconds * 1000 + i64::from(t.nanos) / 1_000_000)
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// RFC 3339 text (UTC, seconds precision) of `ms` since the epoch.
pub fn rfc3339(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}
