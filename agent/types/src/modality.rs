//! Input modalities as a small set (the WIT `modalities` flags).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A set of input modalities: what a request uses, or what a target accepts.
///
/// Written and read as a list of names (`["text", "image"]`); an unknown name is an
/// error that lists the known ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Modalities(u8);

impl Modalities {
    /// No modality: for a target, "unknown" (it is not filtered on modality).
    pub const EMPTY: Self = Self(0);
    /// Plain text.
    pub const TEXT: Self = Self(1);
    /// Images.
    pub const IMAGE: Self = Self(1 << 1);
    /// Audio.
    pub const AUDIO: Self = Self(1 << 2);
    /// Documents (PDF and other files).
    pub const DOCUMENT: Self = Self(1 << 3);

    /// Every modality with its name, in WIT order.
    pub const NAMED: [(&'static str, Self); 4] = [
        ("text", Self::TEXT),
        ("image", Self::IMAGE),
        ("audio", Self::AUDIO),
        ("document", Self::DOCUMENT),
    ];

    /// The modality called `name`, or an error naming the known ones.
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::NAMED
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, m)| *m)
            .ok_or_else(|| {
                format!(
                    "unknown modality {name:?}; known: {}",
                    Self::NAMED.map(|(n, _)| n).join(", ")
                )
            })
    }

    /// The set of the named modalities.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Self, String> {
        names
            .iter()
            .try_fold(Self::EMPTY, |set, n| Ok(set | Self::parse(n.as_ref())?))
    }

    /// The names in the set, in WIT order.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        Self::NAMED
            .into_iter()
            .filter(move |(_, m)| self.contains(*m))
            .map(|(n, _)| n)
    }

    /// The bits, in WIT flag order (text is bit 0).
    pub fn bits(self) -> u8 {
        self.0
    }

    /// The set with these bits; bits beyond the known modalities are dropped.
    pub fn from_bits_truncate(bits: u8) -> Self {
        Self(bits & 0b1111)
    }

    /// Whether every modality of `other` is in `self`.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl std::ops::BitOr for Modalities {
    type Output = Self;

    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl std::ops::BitOrAssign for Modalities {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

impl Serialize for Modalities {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.names())
    }
}

impl<'de> Deserialize<'de> for Modalities {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let names = Vec::<String>::deserialize(deserializer)?;
        Self::from_names(&names).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        let set = Modalities::from_names(&["image", "text"]).unwrap();
        assert_eq!(set, Modalities::TEXT | Modalities::IMAGE);
        assert_eq!(set.names().collect::<Vec<_>>(), ["text", "image"]);
        let json = serde_json::to_string(&set).unwrap();
        assert_eq!(json, r#"["text","image"]"#);
        assert_eq!(serde_json::from_str::<Modalities>(&json).unwrap(), set);
        let err = Modalities::parse("video").unwrap_err();
        assert!(
            err.contains("\"video\"") && err.contains("document"),
            "{err}"
        );
        assert!(serde_json::from_str::<Modalities>(r#"["txt"]"#).is_err());
    }

    #[test]
    fn containment() {
        let text = Modalities::TEXT;
        let both = Modalities::TEXT | Modalities::IMAGE;
        assert!(both.contains(text));
        assert!(!text.contains(both));
        assert!(text.contains(Modalities::EMPTY));
        assert!(Modalities::EMPTY.is_empty());
        assert_eq!(Modalities::from_bits_truncate(0xff).bits(), 0b1111);
    }
}
