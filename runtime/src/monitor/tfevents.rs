//! TensorBoard's event-file format, written by hand: no maintained crate writes it (the
//! `tensorboard-rs` family is unmaintained and pulls in a protobuf stack for three messages).
//!
//! A file is a sequence of TFRecords: the data's length (u64, little-endian), the masked
//! CRC32C of those 8 bytes, the data, the masked CRC32C of the data. Each record's data is an
//! `Event` protocol buffer (`tensorflow/core/util/event.proto`): the first carries
//! `file_version = "brain.Event:2"`, the others a `Summary` of scalar values.

use std::io::{self, Write};

/// TensorFlow's CRC mask: rotate right by 15 and add a constant, so that a CRC of data that
/// itself contains CRCs stays well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Writes one TFRecord holding `data`.
pub fn write_record(out: &mut impl Write, data: &[u8]) -> io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc32c(&len).to_le_bytes())?;
    out.write_all(data)?;
    out.write_all(&masked_crc32c(data).to_le_bytes())
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// `Event { wall_time = 1 (double), step = 2 (int64) }` and the rest of its fields in `tail`.
fn event(wall_time: f64, step: i64, tail: &[u8]) -> Vec<u8> {
    let mut e = Vec::with_capacity(tail.len() + 20);
    e.push(1 << 3 | 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    e.push(2 << 3);
    // int64 is encoded as its two's-complement u64, as protobuf does.
    varint(&mut e, step as u64);
    e.extend_from_slice(tail);
    e
}

/// The first event of every file: `file_version = 3 (string)`.
pub fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut tail = Vec::new();
    bytes_field(&mut tail, 3, b"brain.Event:2");
    event(wall_time, 0, &tail)
}

/// An event whose `summary = 5` holds one `Summary.Value { tag = 1, simple_value = 2 (float) }`
/// per scalar.
pub fn scalars_event(wall_time: f64, step: i64, scalars: &[(String, f64)]) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, v) in scalars {
        let mut value = Vec::with_capacity(tag.len() + 8);
        bytes_field(&mut value, 1, tag.as_bytes());
        value.push(2 << 3 | 5);
        value.extend_from_slice(&(*v as f32).to_le_bytes());
        bytes_field(&mut summary, 1, &value);
    }
    let mut tail = Vec::new();
    bytes_field(&mut tail, 5, &summary);
    event(wall_time, step, &tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_tensorflow_masking() {
        // crc32c("123456789") = 0xE3069283, TensorFlow's check value before masking.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let masked = 0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), masked);
    }

    #[test]
    fn record_frames_length_and_checksums() {
        let mut out = Vec::new();
        write_record(&mut out, b"abc").unwrap();
        assert_eq!(out.len(), 8 + 4 + 3 + 4);
        assert_eq!(&out[..8], &3u64.to_le_bytes());
        assert_eq!(
            &out[8..12],
            &masked_crc32c(&3u64.to_le_bytes()).to_le_bytes()
        );
        assert_eq!(&out[12..15], b"abc");
        assert_eq!(&out[15..], &masked_crc32c(b"abc").to_le_bytes());
    }

    #[test]
    fn scalar_event_encodes_tag_value_and_step() {
        let e = scalars_event(1.5, 300, &[("a/b".into(), 2.0)]);
        assert_eq!(e[0], 0x09);
        assert_eq!(&e[1..9], &1.5f64.to_le_bytes());
        // step 300 = varint ac 02
        assert_eq!(&e[9..12], &[0x10, 0xac, 0x02]);
        // summary (field 5) > value (field 1) > tag "a/b", simple_value 2.0f32
        let value = [0x0a, 3, b'a', b'/', b'b', 0x15, 0, 0, 0, 0x40];
        assert_eq!(&e[12..], &[&[0x2a, 12, 0x0a, 10][..], &value].concat()[..]);
    }
}
