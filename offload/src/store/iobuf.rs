//! What the store reads into and writes from: bytes, or a size-only buffer (a length and no
//! bytes) that only a meta store accepts. The engine's size-only run swaps buffers that have
//! no bytes, and the store, not the engine, knows whether that is acceptable.

/// A buffer a store operation writes from.
pub trait IoSrc {
    /// The bytes, or `None` for a size-only buffer.
    fn io_bytes(&self) -> Option<&[u8]>;
}

/// A buffer a store operation reads into.
pub trait IoDst {
    /// The bytes, or `None` for a size-only buffer (a meta store leaves it as it is).
    fn io_bytes_mut(&mut self) -> Option<&mut [u8]>;
}

impl<T: AsRef<[u8]> + ?Sized> IoSrc for T {
    fn io_bytes(&self) -> Option<&[u8]> {
        Some(self.as_ref())
    }
}

impl<T: AsMut<[u8]> + ?Sized> IoDst for T {
    fn io_bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(self.as_mut())
    }
}

use super::{Inner, Medium};
use crate::{Error, Result};

impl Inner {
    /// Writes `len` bytes of `src` under `key`; a size-only buffer only to a meta store, which
    /// records the length as it does for bytes.
    pub(super) fn write_from(
        &self,
        key: &str,
        src: &(impl IoSrc + ?Sized),
        len: usize,
        op: &'static str,
    ) -> Result<()> {
        match src.io_bytes() {
            Some(b) => match b.get(..len) {
                Some(data) => self.write(key, data),
                None => Err(too_short(op, key, b.len(), len)),
            },
            None => {
                self.size_only(op, key)?;
                self.index_mut().remove(key);
                super::dir::file_name(key)?;
                self.record(key, len, Vec::new());
                Ok(())
            }
        }
    }

    /// Reads `key`'s `len` bytes into `dst`; a size-only buffer only from a meta store, which
    /// checks the length as it does for bytes and leaves the buffer as it is.
    pub(super) fn read_into(
        &self,
        key: &str,
        dst: &mut (impl IoDst + ?Sized),
        len: usize,
        op: &'static str,
    ) -> Result<()> {
        match dst.io_bytes_mut() {
            Some(b) => {
                let have = b.len();
                match b.get_mut(..len) {
                    Some(d) => self.read(key, d),
                    None => Err(too_short(op, key, have, len)),
                }
            }
            None => {
                self.size_only(op, key)?;
                self.read_len(key, len)
            }
        }
    }

    /// Refuses a size-only buffer unless this store moves no bytes.
    fn size_only(&self, op: &'static str, key: &str) -> Result<()> {
        match self.medium {
            Medium::Meta => Ok(()),
            Medium::Files { .. } => Err(Error::Invalid {
                op,
                detail: format!(
                    "tensor {key:?}: a size-only buffer (no bytes) handed to a store with files \
                     in {}",
                    self.dir.display()
                ),
            }),
        }
    }
}

fn too_short(op: &'static str, key: &str, have: usize, len: usize) -> Error {
    Error::Length {
        op,
        detail: format!("tensor {key:?}: buffer of {have} bytes for {len} bytes"),
    }
}
