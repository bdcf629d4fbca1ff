//! A request's headers as proxy-wasm hands them over in one host call (the
//! serialized pairs of `proxy_get_header_map_pairs`), read in place: one
//! host call and one buffer per request instead of a call and a string per
//! header looked at. Also the client headers no request may keep.
//!
//! Layout (proxy-wasm ABI): a little-endian u32 count of pairs, then a u32
//! key length and a u32 value length per pair, then each key and each value
//! followed by a NUL byte. A block that does not follow it reads as having
//! fewer (or no) pairs; nothing here panics.

/// Headers with which a client could choose the rank or the PD bootstrap on
/// the server itself (docs/rank-headers.md): removed from every request,
/// routed or not, in every mode. Envoy keeps header names lowercase, so these
/// names match any casing the client used.
pub const CLIENT_RANK_HEADERS: [&str; 6] = [
    "x-data-parallel-rank",
    "x-override-routed-dp-rank",
    "x-override-disagg-prefill-dp-rank",
    "x-override-bootstrap-host",
    "x-override-bootstrap-port",
    "x-override-bootstrap-room",
];

/// The header SGLang reads a request's scheduling priority from (with
/// SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES): set in header mode with
/// `admission.server_priority`, which also removes every client's.
pub const SERVER_PRIORITY_HEADER: &str = "x-override-priority";

/// Whether `name` is a header name as Envoy keeps them: lowercase
/// letters, digits, `-` and `_` (what configuration keys naming headers
/// accept).
pub fn is_lowercase_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// The serialized header pairs of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    bytes: Vec<u8>,
}

fn u32_at(bytes: &[u8], at: usize) -> Option<usize> {
    let word: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_le_bytes(word) as usize)
}

impl HeaderMap {
    /// A block as the host returned it.
    pub fn from_serialized(bytes: Vec<u8>) -> HeaderMap {
        HeaderMap { bytes }
    }

    /// Serializes `pairs` the way the host does (tests and fakes).
    pub fn from_pairs<K: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(K, V)]) -> HeaderMap {
        let mut bytes = (pairs.len() as u32).to_le_bytes().to_vec();
        for (k, v) in pairs {
            bytes.extend_from_slice(&(k.as_ref().len() as u32).to_le_bytes());
            bytes.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
        }
        for (k, v) in pairs {
            bytes.extend_from_slice(k.as_ref());
            bytes.push(0);
            bytes.extend_from_slice(v.as_ref());
            bytes.push(0);
        }
        HeaderMap { bytes }
    }

    /// Every (name, value) pair in order, duplicates included.
    pub fn iter(&self) -> Pairs<'_> {
        let count = u32_at(&self.bytes, 0).unwrap_or(0);
        // Each pair takes 8 bytes of sizes: a count beyond that is a bad block.
        let sizes_end = count
            .checked_mul(8)
            .and_then(|n| n.checked_add(4))
            .filter(|end| *end <= self.bytes.len());
        Pairs {
            bytes: &self.bytes,
            next_size: 4,
            sizes_end: sizes_end.unwrap_or(4),
            data: sizes_end.unwrap_or(self.bytes.len()),
        }
    }

    /// The first value of `name` (lowercase), as bytes.
    pub fn get_bytes(&self, name: &str) -> Option<&[u8]> {
        self.iter().find(|(k, _)| *k == name.as_bytes()).map(|(_, v)| v)
    }

    /// The first value of `name` (lowercase), if it is UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.get_bytes(name)?).ok()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.get_bytes(name).is_some()
    }

    /// `content-length` as a number, if present and well-formed.
    pub fn content_length(&self) -> Option<u64> {
        self.get("content-length")?.trim().parse().ok()
    }
}

/// The pairs of a [`HeaderMap`], read in place.
pub struct Pairs<'a> {
    bytes: &'a [u8],
    /// Where the next pair's sizes are.
    next_size: usize,
    sizes_end: usize,
    /// Where the next pair's key starts.
    data: usize,
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.next_size >= self.sizes_end {
            return None;
        }
        let key_len = u32_at(self.bytes, self.next_size)?;
        let value_len = u32_at(self.bytes, self.next_size + 4)?;
        self.next_size += 8;
        let key_end = self.data.checked_add(key_len)?;
        let key = self.bytes.get(self.data..key_end)?;
        let value_start = key_end.checked_add(1)?;
        let value_end = value_start.checked_add(value_len)?;
        let value = self.bytes.get(value_start..value_end)?;
        self.data = value_end.checked_add(1)?;
        Some((key, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip_in_order_with_duplicates() {
        let pairs = [
            (":method", "POST"),
            ("x-a", ""),
            ("x-a", "2"),
            ("content-length", " 12 "),
        ];
        let map = HeaderMap::from_pairs(&pairs);
        let read: Vec<(&[u8], &[u8])> = map.iter().collect();
        let expected: Vec<(&[u8], &[u8])> = pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())).collect();
        assert_eq!(read, expected);
        assert_eq!(map.get("x-a"), Some(""), "the first of duplicates");
        assert_eq!(map.get(":method"), Some("POST"));
        assert_eq!(map.get("x-b"), None);
        assert_eq!(map.content_length(), Some(12));
        assert!(map.contains("x-a") && !map.contains("X-A"));
    }

    #[test]
    fn values_that_are_not_utf8_are_readable_as_bytes_only() {
        let map = HeaderMap::from_pairs(&[(&b"content-encoding"[..], &b"gz\xe9"[..])]);
        assert_eq!(map.get("content-encoding"), None);
        assert_eq!(map.get_bytes("content-encoding"), Some(&b"gz\xe9"[..]));
        assert_eq!(map.content_length(), None);
    }

    #[test]
    fn malformed_blocks_read_as_fewer_pairs_without_panicking() {
        let good = HeaderMap::from_pairs(&[("a", "1"), ("bb", "22")]).bytes;
        assert_eq!(HeaderMap::default().iter().count(), 0);
        for cut in 0..good.len() {
            let map = HeaderMap::from_serialized(good[..cut].to_vec());
            assert!(map.iter().count() <= 2);
        }
        let mut huge_count = good.clone();
        huge_count[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::from_serialized(huge_count).iter().count(), 0);
        let mut huge_len = good.clone();
        huge_len[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::from_serialized(huge_len).iter().count(), 0);
    }
}
