//! The argument checks every backend makes before its own work, written once so that each
//! device refuses the same calls with the same words. They read lengths and ids only: where a
//! view lives and which dtypes a device takes stay the backend's to check.

use super::{HeadShape, MatmulShape, IGNORE_INDEX};
use crate::{Error, Result};

/// Fails unless `got == want`.
pub(crate) fn expect_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(Error::Shape {
        op,
        expected: format!("{what} with {want} elements"),
        got: format!("{got}"),
    })
}

/// Fails on the first `(what, len)` whose length is not `want`.
pub(crate) fn same_len(op: &'static str, want: usize, got: &[(&str, usize)]) -> Result<()> {
    got.iter()
        .try_for_each(|&(what, len)| expect_len(op, what, len, want))
}

/// `len / by`, after checking that `by` divides `len` exactly (`expected` says what the
/// elements had to be); `by` of zero is refused.
pub(crate) fn exact_div(
    op: &'static str,
    len: usize,
    by: usize,
    expected: impl FnOnce() -> String,
) -> Result<usize> {
    if by == 0 || !len.is_multiple_of(by) {
        return Err(Error::Shape {
            op,
            expected: expected(),
            got: format!("{len} elements"),
        });
    }
    Ok(len / by)
}

/// Rows of `[rows, d]` data in `len` elements, after checking the width (a norm's parameter).
fn rows_of(op: &'static str, len: usize, d: usize) -> Result<usize> {
    exact_div(op, len, d, || {
        format!("whole rows of the parameter width {d}")
    })
}

/// Fails unless `len` elements are whole rows of `cols` (a column sum's input).
pub(crate) fn whole_rows(op: &'static str, len: usize, cols: usize) -> Result<()> {
    exact_div(op, len, cols, || format!("whole rows of {cols}")).map(drop)
}

/// A norm forward's lengths `[x, gamma, y, rstd]` and LayerNorm's `[beta, mean]`: `x` whole
/// rows of gamma's width, `y` like `x`, a statistic per row, `beta` like gamma; the rows.
pub(crate) fn norm_forward(
    op: &'static str,
    [x, d, y, rstd]: [usize; 4],
    layernorm: Option<[usize; 2]>,
) -> Result<usize> {
    let rows = rows_of(op, x, d)?;
    if let Some([beta, _]) = layernorm {
        expect_len(op, "beta", beta, d)?;
    }
    expect_len(op, "y", y, x)?;
    if let Some([_, mean]) = layernorm {
        expect_len(op, "mean", mean, rows)?;
    }
    expect_len(op, "rstd", rstd, rows)?;
    Ok(rows)
}

/// A norm backward's lengths `[x, gamma, dy, dx, rstd, dgamma]` and LayerNorm's `[mean,
/// dbeta]`: `dy` and `dx` like `x`, a statistic per row, parameter gradients like gamma; the
/// rows.
pub(crate) fn norm_backward(
    op: &'static str,
    [x, d, dy, dx, rstd, dgamma]: [usize; 6],
    layernorm: Option<[usize; 2]>,
) -> Result<usize> {
    let rows = rows_of(op, x, d)?;
    same_len(op, x, &[("dy", dy), ("dx", dx)])?;
    if let Some([mean, _]) = layernorm {
        expect_len(op, "mean", mean, rows)?;
    }
    expect_len(op, "rstd", rstd, rows)?;
    expect_len(op, "dgamma", dgamma, d)?;
    if let Some([_, dbeta]) = layernorm {
        expect_len(op, "dbeta", dbeta, d)?;
    }
    Ok(rows)
}

/// Fails on the first token id outside an embedding table of `rows` rows.
pub(crate) fn token_ids(tokens: &[i32], rows: usize) -> Result<()> {
    match tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t as usize >= rows)
    {
        Some((pos, &t)) => Err(Error::Invalid(format!(
            "token id {t} at position {pos} is outside the embedding table of {rows} rows"
        ))),
        None => Ok(()),
    }
}

/// Fails on the first target outside a vocabulary of `vocab` that is not [`IGNORE_INDEX`].
pub(crate) fn target_ids(targets: &[i32], vocab: usize) -> Result<()> {
    match targets
        .iter()
        .find(|&&t| t != IGNORE_INDEX && (t < 0 || t as usize >= vocab))
    {
        Some(&t) => Err(Error::Invalid(format!(
            "target id {t} is outside the vocabulary of {vocab} (use {IGNORE_INDEX} to ignore a position)"
        ))),
        None => Ok(()),
    }
}

/// Fails unless a position table of `table` elements holds `seq` rows of `dim`.
pub(crate) fn positions(op: &'static str, table: usize, seq: usize, dim: usize) -> Result<()> {
    if table < seq * dim {
        return Err(Error::Invalid(format!(
            "{op}: sequence length {seq} exceeds the table's {} positions",
            table / dim.max(1)
        )));
    }
    Ok(())
}

/// A loss head's gradient outputs: `dx` like `x`, `dw` (when given) like the weight.
pub(crate) fn head_grads(
    op: &'static str,
    s: HeadShape,
    dx: usize,
    dw: Option<usize>,
) -> Result<()> {
    expect_len(op, "dx", dx, s.rows * s.dim)?;
    match dw {
        Some(dw) => expect_len(op, "dweight", dw, s.vocab * s.dim),
        None => Ok(()),
    }
}

/// A product's operands against its shape: A holds `m·k` elements, B `k·n`, C `m·n`.
pub(crate) fn matmul(s: MatmulShape, a: usize, b: usize, c: usize) -> Result<()> {
    expect_len("matmul", "A", a, s.m * s.k)?;
    expect_len("matmul", "B", b, s.k * s.n)?;
    expect_len("matmul", "C", c, s.m * s.n)
}
