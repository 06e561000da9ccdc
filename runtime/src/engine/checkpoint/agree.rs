//! Ranks agreeing on the outcome of a checkpoint step: when any rank failed, every rank
//! fails with the same message, naming the failing rank and carrying its own error text (the
//! file, the tensor, the checksums), so the user reads the cause whichever rank's output
//! reaches them, ranks as threads or as processes.

use crate::comm::{BufMut, BufRef, Communicator};
use crate::{Error, Result};

/// Longest text a rank contributes: a runaway message must not make every rank allocate it.
const MAX_TEXT: usize = 1 << 20;

/// Makes every rank fail when any rank failed, so no rank waits at a later collective for
/// a peer that gave up; the error names the lowest failing rank and says what it said.
pub(in crate::engine) fn agree<T>(comm: &dyn Communicator, local: Result<T>) -> Result<T> {
    let text = match &local {
        Err(e) => e.to_string(),
        Ok(_) => String::new(),
    };
    let all = all_gather_text(comm, &text)?;
    match all.iter().position(|t| !t.is_empty()) {
        None => local,
        Some(rank) => Err(Error::RankFailed {
            op: "checkpoint",
            rank,
            cause: all[rank].clone(),
        }),
    }
}

/// Every rank's `mine`, in rank order (collective). Bytes travel one per f32, which the
/// collectives carry exactly; when every text is empty only the lengths move.
pub(in crate::engine) fn all_gather_text(
    comm: &dyn Communicator,
    mine: &str,
) -> Result<Vec<String>> {
    let mut bytes = mine.as_bytes();
    if bytes.len() > MAX_TEXT {
        bytes = &bytes[..MAX_TEXT];
    }
    let world = comm.world_size();
    let mut lens = vec![0.0f32; world];
    comm.all_gather(BufRef::F32(&[bytes.len() as f32]), BufMut::F32(&mut lens))?;
    let longest = lens.iter().fold(0.0f32, |m, &l| m.max(l)) as usize;
    if longest == 0 {
        return Ok(vec![String::new(); world]);
    }
    let mut local = vec![0.0f32; longest];
    for (d, &b) in local.iter_mut().zip(bytes) {
        *d = f32::from(b);
    }
    let mut all = vec![0.0f32; longest * world];
    comm.all_gather(BufRef::F32(&local), BufMut::F32(&mut all))?;
    Ok(all
        .chunks_exact(longest)
        .zip(&lens)
        .map(|(c, &n)| {
            let b: Vec<u8> = c[..n as usize].iter().map(|&x| x as u8).collect();
            String::from_utf8_lossy(&b).into_owned()
        })
        .collect())
}
