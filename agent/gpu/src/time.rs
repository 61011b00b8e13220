//! Wall-clock times on the wire: RFC 3339 with milliseconds, UTC.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serializer;

/// The last instant RFC 3339 can write (9999-12-31T23:59:59Z).
const LATEST: Duration = Duration::from_secs(253_402_300_799);

/// `time` as RFC 3339; times outside what the format can express are clamped rather
/// than allowed to panic the formatter.
pub fn rfc3339(time: SystemTime) -> String {
    let clamped = time.clamp(UNIX_EPOCH, UNIX_EPOCH + LATEST);
    humantime::format_rfc3339_millis(clamped).to_string()
}

/// Seconds since the Unix epoch, for metrics.
pub fn unix_seconds(time: SystemTime) -> f64 {
    time.duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs_f64())
        .unwrap_or(0.0)
}

pub fn serialize<S: Serializer>(time: &SystemTime, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&rfc3339(*time))
}

pub mod option {
    use std::time::SystemTime;

    use serde::Serializer;

    pub fn serialize<S: Serializer>(
        time: &Option<SystemTime>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match time {
            Some(time) => serializer.serialize_some(&super::rfc3339(*time)),
            None => serializer.serialize_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_clamps() {
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_millis(1_700_000_000_123)),
            "2023-11-14T22:13:20.123Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH - Duration::from_secs(5)),
            "1970-01-01T00:00:00.000Z"
        );
        assert_eq!(unix_seconds(UNIX_EPOCH + Duration::from_millis(1500)), 1.5);
    }
}
