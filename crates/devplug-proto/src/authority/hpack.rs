//! HPACK (RFC 7541) for the `:authority` adapter: a decoder that follows the client's dynamic
//! table, and the one representation the adapter emits (a literal without indexing).
//!
//! Written here rather than taken from a crate because the adapter decodes on the connection's
//! hot path: the Huffman decoder below walks the canonical code with integer arithmetic (a few
//! nanoseconds a bit), where the HPACK crates we looked at built hash tables per string and
//! added ~180 µs to a connection's first request.

use std::collections::VecDeque;
use std::sync::OnceLock;

/// A header field: name and value bytes.
pub(crate) type Field = (Vec<u8>, Vec<u8>);

/// Why a header block did not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HpackError {
    /// The block ended inside a representation.
    #[error("header block truncated")]
    Truncated,
    /// An integer longer than any header block could need.
    #[error("integer overflow")]
    Overflow,
    /// An index outside the static and dynamic tables.
    #[error("no table entry {0}")]
    Index(usize),
    /// Bad Huffman data: the EOS symbol, or padding that is not a prefix of EOS.
    #[error("invalid Huffman string")]
    Huffman,
    /// A dynamic table size update above what the connection allows.
    #[error("dynamic table size {0} over the limit")]
    TableSize(usize),
}

/// The static table, RFC 7541 Appendix A (index 1 first).
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// Bytes an entry adds to the dynamic table besides its name and value (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;

/// Decodes a connection's header blocks in order, keeping the dynamic table the client's encoder
/// keeps.
pub(crate) struct Decoder {
    /// Newest entry first, as HPACK indexes them.
    dynamic: VecDeque<Field>,
    size: usize,
    max_size: usize,
    /// The most the client may grow the table to (the server's SETTINGS_HEADER_TABLE_SIZE).
    limit: usize,
}

impl Decoder {
    /// A decoder for a new connection whose table may grow to `limit` bytes.
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            dynamic: VecDeque::new(),
            size: 0,
            max_size: limit,
            limit,
        }
    }

    /// Decodes one complete header block (HEADERS plus its CONTINUATION fragments).
    pub(crate) fn decode(&mut self, block: &[u8]) -> Result<Vec<Field>, HpackError> {
        let mut fields = Vec::new();
        let mut pos = 0;
        while let Some(&first) = block.get(pos) {
            if first & 0x80 != 0 {
                let index = decode_int(block, &mut pos, 7)?;
                fields.push(self.entry(index)?);
            } else if first & 0x40 != 0 {
                let field = self.literal(block, &mut pos, 6)?;
                self.insert(field.clone());
                fields.push(field);
            } else if first & 0x20 != 0 {
                let size = decode_int(block, &mut pos, 5)?;
                if size > self.limit {
                    return Err(HpackError::TableSize(size));
                }
                self.max_size = size;
                self.evict(0);
            } else {
                // Without indexing (0000) or never indexed (0001): 4-bit name index.
                fields.push(self.literal(block, &mut pos, 4)?);
            }
        }
        Ok(fields)
    }

    /// A literal field whose name index has a `prefix`-bit prefix.
    fn literal(&self, block: &[u8], pos: &mut usize, prefix: u8) -> Result<Field, HpackError> {
        let index = decode_int(block, pos, prefix)?;
        let name = if index == 0 {
            decode_string(block, pos)?
        } else {
            self.entry(index)?.0
        };
        Ok((name, decode_string(block, pos)?))
    }

    /// The entry at a 1-based HPACK index: static table, then dynamic, newest first.
    fn entry(&self, index: usize) -> Result<Field, HpackError> {
        if let Some((name, value)) = index.checked_sub(1).and_then(|i| STATIC_TABLE.get(i)) {
            return Ok((name.as_bytes().to_vec(), value.as_bytes().to_vec()));
        }
        index
            .checked_sub(STATIC_TABLE.len() + 1)
            .and_then(|i| self.dynamic.get(i))
            .cloned()
            .ok_or(HpackError::Index(index))
    }

    fn insert(&mut self, field: Field) {
        let size = field.0.len() + field.1.len() + ENTRY_OVERHEAD;
        self.evict(size);
        if size <= self.max_size {
            self.size += size;
            self.dynamic.push_front(field);
        }
    }

    /// Drops the oldest entries until `room` more bytes fit (or the table is empty).
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            let Some((name, value)) = self.dynamic.pop_back() else {
                break;
            };
            self.size -= name.len() + value.len() + ENTRY_OVERHEAD;
        }
    }
}

/// Decodes an HPACK integer with a `prefix`-bit prefix at `pos` (RFC 7541 §5.1).
fn decode_int(block: &[u8], pos: &mut usize, prefix: u8) -> Result<usize, HpackError> {
    let max_prefix = (1usize << prefix) - 1;
    let first = *block.get(*pos).ok_or(HpackError::Truncated)?;
    *pos += 1;
    let mut value = usize::from(first) & max_prefix;
    if value < max_prefix {
        return Ok(value);
    }
    // Four continuation bytes (28 bits) are far more than any header block can use.
    for shift in [0, 7, 14, 21] {
        let byte = *block.get(*pos).ok_or(HpackError::Truncated)?;
        *pos += 1;
        value += usize::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(HpackError::Overflow)
}

/// Decodes a string literal at `pos`: raw or Huffman-coded (RFC 7541 §5.2).
fn decode_string(block: &[u8], pos: &mut usize) -> Result<Vec<u8>, HpackError> {
    let huffman = block.get(*pos).ok_or(HpackError::Truncated)? & 0x80 != 0;
    let len = decode_int(block, pos, 7)?;
    let end = pos.checked_add(len).ok_or(HpackError::Overflow)?;
    let bytes = block.get(*pos..end).ok_or(HpackError::Truncated)?;
    *pos = end;
    if huffman {
        huffman_decode(bytes)
    } else {
        Ok(bytes.to_vec())
    }
}

/// Appends a "literal header field without indexing, new name" (RFC 7541 §6.2.2) with raw
/// strings. Such fields never touch the receiver's dynamic table.
pub(crate) fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    encode_string(out, name);
    encode_string(out, value);
}

/// Appends a raw string literal: a 7-bit-prefix length (Huffman bit clear), then the bytes.
fn encode_string(out: &mut Vec<u8>, bytes: &[u8]) {
    let mut len = bytes.len();
    if len < 0x7f {
        out.push(len as u8);
    } else {
        out.push(0x7f);
        len -= 0x7f;
        while len >= 0x80 {
            out.push((len & 0x7f) as u8 | 0x80);
            len >>= 7;
        }
        out.push(len as u8);
    }
    out.extend_from_slice(bytes);
}

/// Code length in bits of each symbol (bytes 0–255, then EOS = 256) in the HPACK Huffman code,
/// RFC 7541 Appendix B. The code is canonical, so the lengths determine every code.
const HUFFMAN_CODE_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
];
const MAX_CODE_LENGTH: usize = 30;
const EOS: u16 = 256;

/// The canonical code in decoding form: for each length, its first code, how many codes have
/// it, and where its symbols start in `symbols` (sorted by length, then symbol).
struct Canonical {
    first_code: [u32; MAX_CODE_LENGTH + 1],
    count: [u32; MAX_CODE_LENGTH + 1],
    offset: [usize; MAX_CODE_LENGTH + 1],
    symbols: Vec<u16>,
}

fn canonical() -> &'static Canonical {
    static CODE: OnceLock<Canonical> = OnceLock::new();
    CODE.get_or_init(|| {
        let mut count = [0u32; MAX_CODE_LENGTH + 1];
        for &len in &HUFFMAN_CODE_LENGTHS {
            count[usize::from(len)] += 1;
        }
        let mut first_code = [0u32; MAX_CODE_LENGTH + 1];
        let mut offset = [0usize; MAX_CODE_LENGTH + 1];
        let (mut code, mut start) = (0u32, 0usize);
        for len in 1..=MAX_CODE_LENGTH {
            code = (code + count[len - 1]) << 1;
            first_code[len] = code;
            offset[len] = start;
            start += count[len] as usize;
        }
        let mut symbols: Vec<u16> = (0..=EOS).collect();
        symbols.sort_by_key(|&s| (HUFFMAN_CODE_LENGTHS[usize::from(s)], s));
        Canonical {
            first_code,
            count,
            offset,
            symbols,
        }
    })
}

/// Decodes a Huffman-coded string (RFC 7541 §5.2): EOS inside the string or padding longer than
/// 7 bits or not all ones is an error.
fn huffman_decode(bytes: &[u8]) -> Result<Vec<u8>, HpackError> {
    let code = canonical();
    let mut out = Vec::with_capacity(bytes.len() * 8 / 5);
    let (mut acc, mut len) = (0u32, 0usize);
    for byte in bytes {
        for bit in (0..8).rev() {
            acc = (acc << 1) | u32::from((byte >> bit) & 1);
            len += 1;
            if len > MAX_CODE_LENGTH {
                return Err(HpackError::Huffman);
            }
            let index = acc.wrapping_sub(code.first_code[len]);
            if acc >= code.first_code[len] && index < code.count[len] {
                let symbol = code.symbols[code.offset[len] + index as usize];
                let symbol = u8::try_from(symbol).map_err(|_| HpackError::Huffman)?;
                out.push(symbol);
                acc = 0;
                len = 0;
            }
        }
    }
    // Padding: at most 7 bits, all ones (the most significant bits of EOS).
    if len > 7 || acc != (1u32 << len) - 1 {
        return Err(HpackError::Huffman);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Huffman-encodes with the canonical code (the inverse of `huffman_decode`).
    fn huffman_encode(input: &[u8]) -> Vec<u8> {
        let code = canonical();
        let (mut bits, mut nbits, mut out) = (0u64, 0u32, Vec::new());
        for &b in input {
            let len = usize::from(HUFFMAN_CODE_LENGTHS[usize::from(b)]);
            let rank = code.symbols[code.offset[len]..]
                .iter()
                .position(|&s| s == u16::from(b))
                .unwrap();
            bits = (bits << len) | u64::from(code.first_code[len] + rank as u32);
            nbits += len as u32;
            while nbits >= 8 {
                out.push((bits >> (nbits - 8)) as u8);
                nbits -= 8;
            }
        }
        if nbits > 0 {
            out.push(((bits << (8 - nbits)) as u8) | ((1u8 << (8 - nbits)) - 1));
        }
        out
    }

    #[test]
    fn rfc_7541_c4_requests_with_huffman() {
        // RFC 7541 C.4.1–C.4.3: three requests on one connection sharing a dynamic table.
        let blocks: [&[u8]; 3] = [
            &[
                0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab,
                0x90, 0xf4, 0xff,
            ],
            &[
                0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf,
            ],
            &[
                0x82, 0x87, 0x85, 0xbf, 0x40, 0x88, 0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xa9, 0x7d, 0x7f,
                0x89, 0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xb8, 0xe8, 0xb4, 0xbf,
            ],
        ];
        let text = |fields: Vec<Field>| -> Vec<(String, String)> {
            fields
                .into_iter()
                .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                .collect()
        };
        let pairs = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect()
        };
        let mut decoder = Decoder::new(4096);
        assert_eq!(
            text(decoder.decode(blocks[0]).unwrap()),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ])
        );
        assert_eq!(
            text(decoder.decode(blocks[1]).unwrap()),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache")
            ])
        );
        assert_eq!(
            text(decoder.decode(blocks[2]).unwrap()),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value")
            ])
        );
        assert_eq!(decoder.size, 164, "RFC 7541 C.4.3: table size 164");
    }

    #[test]
    fn huffman_code_matches_an_independent_decoder() {
        // Every byte value, encoded with our canonical code, decodes the same in loona-hpack,
        // whose table lists the RFC's codes explicitly.
        let all: Vec<u8> = (0..=255).collect();
        for input in [
            &all[..],
            b"/var/lib/kubelet/device-plugins/vendor.sock",
            b"",
            b"a",
        ] {
            let encoded = huffman_encode(input);
            let theirs = loona_hpack::huffman::HuffmanDecoder::new()
                .decode(&encoded)
                .unwrap();
            assert_eq!(theirs, input);
            assert_eq!(huffman_decode(&encoded).unwrap(), input);
        }
    }

    #[test]
    fn static_table_matches_an_independent_decoder() {
        let mut theirs = loona_hpack::Decoder::new();
        for index in 1..=61u8 {
            let ours = Decoder::new(4096).decode(&[0x80 | index]).unwrap();
            assert_eq!(
                ours,
                theirs.decode(&[0x80 | index]).unwrap(),
                "index {index}"
            );
        }
    }

    #[test]
    fn bad_input_is_an_error_never_a_panic() {
        let mut decoder = Decoder::new(4096);
        assert_eq!(decoder.decode(&[0x80]), Err(HpackError::Index(0)));
        assert_eq!(decoder.decode(&[0xbe]), Err(HpackError::Index(62)));
        assert_eq!(
            decoder.decode(&[0x41, 0x85, 0xff]),
            Err(HpackError::Truncated)
        );
        assert_eq!(
            decoder.decode(&[0x3f, 0xe2, 0x1f]),
            Err(HpackError::TableSize(4097))
        );
        assert_eq!(
            decoder.decode(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]),
            Err(HpackError::Overflow)
        );
        // EOS (30 ones) inside a string; padding of 8 ones.
        assert_eq!(
            huffman_decode(&[0xff, 0xff, 0xff, 0xfc]),
            Err(HpackError::Huffman)
        );
        assert_eq!(huffman_decode(&[0xff]), Err(HpackError::Huffman));
        // Padding that is not all ones.
        assert_eq!(huffman_decode(&[0x00]), Err(HpackError::Huffman));
        // Pseudo-random blocks: errors or fields, but no panic.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            let len = (seed % 24) as usize;
            let block: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let _ = decoder.decode(&block);
        }
    }

    #[test]
    fn table_size_updates_evict() {
        let mut decoder = Decoder::new(4096);
        // Literal with indexing, new name "a" = "b" (34 bytes in the table).
        decoder.decode(&[0x40, 0x01, b'a', 0x01, b'b']).unwrap();
        assert_eq!(
            decoder.decode(&[0xbe]).unwrap(),
            [(b"a".to_vec(), b"b".to_vec())]
        );
        // Size update to 0 empties the table.
        decoder.decode(&[0x20]).unwrap();
        assert_eq!(decoder.decode(&[0xbe]), Err(HpackError::Index(62)));
    }

    #[test]
    fn literal_lengths_use_the_hpack_integer_encoding() {
        for len in [0, 1, 126, 127, 128, 255, 300, 70_000] {
            let mut out = Vec::new();
            encode_literal(&mut out, b"n", &vec![b'v'; len]);
            let decoded = Decoder::new(4096).decode(&out).unwrap();
            assert_eq!(decoded, [(b"n".to_vec(), vec![b'v'; len])]);
        }
    }
}
