//! KVM state structs in the snapshot's state file as hex strings.
//!
//! kvm-bindings serializes its structs as byte arrays, which JSON writes as arrays of numbers:
//! ~20,000 of them for one vCPU (CPUID, MSRs, xsave, LAPIC, interrupt controllers), and
//! parsing them one element at a time was most of a restore's state read. A hex string reads
//! in one pass. Older state files (number arrays) still read: both forms are accepted.
//!
//! Use with `#[serde(with = "crate::snapshot::blob")]` on a field of a kvm-bindings type, and
//! `crate::snapshot::blob::list` on a `Vec` of them.

use serde::de::{self, value::BytesDeserializer, Deserialize, Deserializer, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, Serializer};
use zerocopy::{Immutable, IntoBytes};

const HEX: &[u8; 16] = b"0123456789abcdef";

fn to_hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
    out
}

fn from_hex<E: de::Error>(text: &str) -> Result<Vec<u8>, E> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let text = text.as_bytes();
    if !text.len().is_multiple_of(2) {
        return Err(E::custom(format!(
            "a hex blob of odd length {}",
            text.len()
        )));
    }
    text.chunks_exact(2)
        .map(|pair| match (nibble(pair[0]), nibble(pair[1])) {
            (Some(hi), Some(lo)) => Ok(hi << 4 | lo),
            _ => Err(E::custom(format!(
                "{:?} in a hex blob is not a hex digit pair",
                String::from_utf8_lossy(pair)
            ))),
        })
        .collect()
}

/// The raw bytes of one blob: a hex string (now) or an array of numbers (older files).
struct RawBlob(Vec<u8>);

impl<'de> Deserialize<'de> for RawBlob {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RawVisitor;
        impl<'de> Visitor<'de> for RawVisitor {
            type Value = RawBlob;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a hex string or an array of bytes")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<RawBlob, E> {
                from_hex(text).map(RawBlob)
            }

            fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<RawBlob, E> {
                Ok(RawBlob(bytes.to_vec()))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawBlob, A::Error> {
                let mut bytes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(b) = seq.next_element::<u8>()? {
                    bytes.push(b);
                }
                Ok(RawBlob(bytes))
            }
        }
        deserializer.deserialize_any(RawVisitor)
    }
}

impl RawBlob {
    /// The kvm-bindings type from these bytes, with its own rules for a length that differs
    /// from its size (zero-padded or truncated).
    fn into_value<'de, T: Deserialize<'de>, E: de::Error>(self) -> Result<T, E> {
        T::deserialize(BytesDeserializer::<E>::new(&self.0))
    }
}

pub fn serialize<T: IntoBytes + Immutable, S: Serializer>(
    value: &T,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&to_hex(value.as_bytes()))
}

pub fn deserialize<'de, T, D>(deserializer: D) -> Result<T, D::Error>
where
    T: for<'a> Deserialize<'a>,
    D: Deserializer<'de>,
{
    RawBlob::deserialize(deserializer)?.into_value()
}

/// A `Vec` of kvm-bindings structs as a list of hex strings.
pub mod list {
    use super::*;

    pub fn serialize<T: IntoBytes + Immutable, S: Serializer>(
        values: &[T],
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(values.len()))?;
        for value in values {
            seq.serialize_element(&to_hex(value.as_bytes()))?;
        }
        seq.end()
    }

    pub fn deserialize<'de, T, D>(deserializer: D) -> Result<Vec<T>, D::Error>
    where
        T: for<'a> Deserialize<'a>,
        D: Deserializer<'de>,
    {
        Vec::<RawBlob>::deserialize(deserializer)?
            .into_iter()
            .map(RawBlob::into_value)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use kvm_bindings::{kvm_lapic_state, kvm_msr_entry, kvm_regs};
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize)]
    struct Sample {
        #[serde(with = "super")]
        regs: kvm_regs,
        #[serde(with = "super")]
        lapic: kvm_lapic_state,
        #[serde(with = "super::list")]
        msrs: Vec<kvm_msr_entry>,
    }

    /// What kvm-bindings alone writes: the same fields as arrays of numbers.
    #[derive(Serialize)]
    struct OldSample {
        regs: kvm_regs,
        lapic: kvm_lapic_state,
        msrs: Vec<kvm_msr_entry>,
    }

    fn sample() -> Sample {
        let mut lapic = kvm_lapic_state::default();
        for (i, b) in lapic.regs.iter_mut().enumerate() {
            *b = (i * 7) as _;
        }
        Sample {
            regs: kvm_regs {
                rip: 0xffff_ffff_8100_325d,
                rsp: 0x1234,
                rflags: 2,
                ..Default::default()
            },
            lapic,
            msrs: vec![
                kvm_msr_entry {
                    index: 0x10,
                    data: 99,
                    ..Default::default()
                },
                kvm_msr_entry {
                    index: 0xc000_0080,
                    data: 0xd01,
                    ..Default::default()
                },
            ],
        }
    }

    fn same(a: &Sample, b: &Sample) -> bool {
        a.regs.rip == b.regs.rip
            && a.regs.rsp == b.regs.rsp
            && a.lapic.regs == b.lapic.regs
            && a.msrs.len() == b.msrs.len()
            && a.msrs
                .iter()
                .zip(&b.msrs)
                .all(|(x, y)| x.index == y.index && x.data == y.data)
    }

    #[test]
    fn kvm_structs_round_trip_as_hex_strings() {
        let json = serde_json::to_string(&sample()).unwrap();
        assert!(
            json.contains("\"regs\":\""),
            "regs not a string: {json:.200}"
        );
        assert!(!json.contains("[0,"), "a number array is left: {json:.200}");
        let back: Sample = serde_json::from_str(&json).unwrap();
        assert!(same(&back, &sample()));
    }

    #[test]
    fn state_written_as_number_arrays_still_reads() {
        let s = sample();
        let old = OldSample {
            regs: s.regs,
            lapic: s.lapic,
            msrs: s.msrs.clone(),
        };
        let json = serde_json::to_string(&old).unwrap();
        assert!(json.contains("\"regs\":["));
        let back: Sample = serde_json::from_str(&json).unwrap();
        assert!(same(&back, &s));
    }

    #[test]
    fn a_bad_hex_blob_is_a_clear_error() {
        let json = serde_json::to_string(&sample()).unwrap();
        let odd = json.replacen("\"regs\":\"", "\"regs\":\"a", 1);
        let err = serde_json::from_str::<Sample>(&odd)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("odd length"), "{err}");
        let bad = json.replacen("\"regs\":\"", "\"regs\":\"zz", 1);
        let err = serde_json::from_str::<Sample>(&bad)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not a hex digit pair"), "{err}");
    }
}
