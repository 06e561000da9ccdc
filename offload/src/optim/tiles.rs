//! Splitting a kernel's slices into tiles run on the current rayon pool.
//!
//! The split is recursive halving with `rayon::join`, so a step allocates nothing and idle
//! threads steal the larger halves first. Tiles never change results: every element is
//! computed the same way wherever it lands.

use super::LowPrecision;

/// Elements below which a tile runs on one thread: 32 Ki f32 is 128 KiB per stream, large
/// enough that the fork costs nothing measurable, small enough to balance 2-64 threads.
const GRAIN: usize = 1 << 15;

/// A set of equally long slices that can be cut at the same index.
pub(super) trait Tile: Send + Sized {
    /// Elements in the tile.
    fn len(&self) -> usize;
    /// Cuts every slice at `mid`.
    fn split_at(self, mid: usize) -> (Self, Self);
}

/// Runs `f` over `tile`, split across the current rayon pool when it is large.
pub(super) fn run<T: Tile>(tile: T, f: &(impl Fn(T) + Sync)) {
    if rayon::current_num_threads() <= 1 {
        f(tile);
    } else {
        split(tile, f);
    }
}

fn split<T: Tile>(tile: T, f: &(impl Fn(T) + Sync)) {
    let n = tile.len();
    if n <= GRAIN {
        f(tile);
        return;
    }
    // Cut on a 64-element boundary so every tile but the last starts on a cache line of the
    // first tile's alignment: neighbours never share (and ping-pong) a line.
    let mid = (n / 2).next_multiple_of(64);
    let (l, r) = tile.split_at(mid);
    rayon::join(|| split(l, f), || split(r, f));
}

/// Adam's slices.
pub(super) struct AdamTile<'a> {
    pub p: &'a mut [f32],
    pub g: &'a [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub lp: LowPrecision<'a>,
}

impl Tile for AdamTile<'_> {
    fn len(&self) -> usize {
        self.p.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (m0, m1) = self.m.split_at_mut(mid);
        let (v0, v1) = self.v.split_at_mut(mid);
        let (l0, l1) = self.lp.split_at(mid);
        let a = AdamTile {
            p: p0,
            g: g0,
            m: m0,
            v: v0,
            lp: l0,
        };
        let b = AdamTile {
            p: p1,
            g: g1,
            m: m1,
            v: v1,
            lp: l1,
        };
        (a, b)
    }
}

/// Slices of an optimizer with one state buffer `s`: SGD's momentum, Lion's moment.
pub(super) struct StateTile<'a> {
    pub p: &'a mut [f32],
    pub g: &'a [f32],
    pub s: &'a mut [f32],
    pub lp: LowPrecision<'a>,
}

impl Tile for StateTile<'_> {
    fn len(&self) -> usize {
        self.p.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (s0, s1) = self.s.split_at_mut(mid);
        let (l0, l1) = self.lp.split_at(mid);
        let a = StateTile {
            p: p0,
            g: g0,
            s: s0,
            lp: l0,
        };
        let b = StateTile {
            p: p1,
            g: g1,
            s: s1,
            lp: l1,
        };
        (a, b)
    }
}

/// LAMB's second pass: the weights and the two moments it reads.
pub(super) struct LambTile<'a> {
    pub p: &'a mut [f32],
    pub m: &'a [f32],
    pub v: &'a [f32],
    pub lp: LowPrecision<'a>,
}

impl Tile for LambTile<'_> {
    fn len(&self) -> usize {
        self.p.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (m0, m1) = self.m.split_at(mid);
        let (v0, v1) = self.v.split_at(mid);
        let (l0, l1) = self.lp.split_at(mid);
        let a = LambTile {
            p: p0,
            m: m0,
            v: v0,
            lp: l0,
        };
        let b = LambTile {
            p: p1,
            m: m1,
            v: v1,
            lp: l1,
        };
        (a, b)
    }
}
