//! Journal timestamps: microseconds since the Unix epoch, printed as RFC 3339.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A point in time as the journal stores it: whole microseconds since the Unix epoch
/// (UTC). Serialized as an RFC 3339 string so exports read without tooling; stored keys
/// use the integer (big-endian) so range scans are ordered by time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(u64);

impl Timestamp {
    pub fn from_micros(micros: u64) -> Self {
        Self(micros)
    }

    pub fn as_micros(self) -> u64 {
        self.0
    }

    /// Times before 1970 clamp to the epoch and times past year 586 524 saturate: the
    /// journal never sees either, and a clamp is better than a panic on a clock jump.
    pub fn from_system(time: SystemTime) -> Self {
        let micros = time
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self(micros)
    }

    pub fn now() -> Self {
        Self::from_system(SystemTime::now())
    }

    pub fn to_system(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_micros(self.0)
    }

    pub fn saturating_add(self, d: Duration) -> Self {
        Self(
            self.0
                .saturating_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
        )
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_rfc3339_micros(self.to_system()))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_rfc3339(&text)
            .map(Self::from_system)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_rfc3339() -> Result<(), serde_json::Error> {
        let t = Timestamp::from_micros(1_767_225_600_123_456);
        let json = serde_json::to_string(&t)?;
        assert_eq!(json, "\"2026-01-01T00:00:00.123456Z\"");
        assert_eq!(serde_json::from_str::<Timestamp>(&json)?, t);
        Ok(())
    }

    #[test]
    fn since_saturates() {
        let a = Timestamp::from_micros(10);
        let b = Timestamp::from_micros(25);
        assert_eq!(b.since(a), Duration::from_micros(15));
        assert_eq!(a.since(b), Duration::ZERO);
    }
}
