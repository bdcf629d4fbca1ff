//! How every record dprank keeps in shared data is written: a 4-byte tag
//! (kind and layout version) followed by postcard, decoded strictly (a value
//! whose tag does not match, that does not decode whole or that is beyond
//! what dprank writes reads as absent), and the byte-string encodings of the
//! records read on every request. Ground floor: each record type declares
//! its own tag beside its layout; `shared_data` names the keys.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A value kept in shared data.
pub trait Record: Serialize + DeserializeOwned {
    /// Kind and layout version; change it whenever the layout changes.
    const TAG: [u8; 4];
    /// Whether a decoded value is within what dprank writes.
    fn within_limits(&self) -> bool {
        true
    }
}

/// The tag, then the record.
pub fn encode<R: Record>(record: &R) -> Vec<u8> {
    let out = R::TAG.to_vec();
    // Writing into a Vec cannot fail; an empty value would read as absent.
    postcard::to_extend(record, out).unwrap_or_default()
}

/// `encode` into a reused buffer; the bytes, or None if encoding failed.
pub fn encode_into<'b, R: Record>(record: &R, buffer: &'b mut Vec<u8>) -> Option<&'b [u8]> {
    let mut out = std::mem::take(buffer);
    out.clear();
    out.extend_from_slice(&R::TAG);
    *buffer = postcard::to_extend(record, out).ok()?;
    Some(buffer.as_slice())
}

/// What `encode` wrote; None for anything else (the caller starts afresh).
pub fn decode<R: Record>(bytes: &[u8]) -> Option<R> {
    let body = bytes.strip_prefix(&R::TAG)?;
    let (record, rest) = postcard::take_from_bytes::<R>(body).ok()?;
    (rest.is_empty() && record.within_limits()).then_some(record)
}

/// A record read in place: it borrows from the value's bytes.
pub trait RecordView<'a>: Deserialize<'a> {
    /// The tag of the record it reads (see `Record::TAG`).
    const TAG: [u8; 4];
    fn within_limits(&self) -> bool;
}

/// What `encode` wrote, read in place; None for anything else.
pub fn decode_view<'a, R: RecordView<'a>>(bytes: &'a [u8]) -> Option<R> {
    let body = bytes.strip_prefix(&R::TAG)?;
    let (record, rest) = postcard::take_from_bytes::<R>(body).ok()?;
    (rest.is_empty() && record.within_limits()).then_some(record)
}

/// `Vec<u64>` as one byte string of little-endian words, for the records read
/// on every request (each worker's state): decoding words in bulk is much
/// faster than one varint at a time (`bench/src/selection.rs` measures it).
pub mod words {
    use serde::de::{Deserializer, Error, Visitor};
    use serde::Serializer;
    use std::fmt;

    pub fn serialize<S: Serializer>(words: &[u64], s: S) -> Result<S::Ok, S::Error> {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        s.serialize_bytes(&bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
        struct Words;
        impl Visitor<'_> for Words {
            type Value = Vec<u64>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("little-endian u64 words")
            }
            fn visit_bytes<E: Error>(self, bytes: &[u8]) -> Result<Vec<u64>, E> {
                if !bytes.len().is_multiple_of(8) {
                    return Err(E::custom("not a whole number of words"));
                }
                let word = |c: &[u8]| u64::from_le_bytes(c.try_into().unwrap_or_default());
                Ok(bytes.chunks_exact(8).map(word).collect())
            }
        }
        d.deserialize_bytes(Words)
    }
}

/// Byte strings kept whole and read in place: `&[u8]` borrowed from the
/// shared-data value on decoding (postcard's bytes: a varint length, then
/// the bytes), so a large record is never copied element by element.
pub mod bytes {
    use serde::de::{Deserializer, Error, Visitor};
    use serde::Serializer;
    use std::fmt;

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct Bytes;
        impl Visitor<'_> for Bytes {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: Error>(self, bytes: &[u8]) -> Result<Vec<u8>, E> {
                Ok(bytes.to_vec())
            }
        }
        d.deserialize_bytes(Bytes)
    }
}
