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

/// A slice of a tile, or its low-precision copy: what splits where the tile does.
trait Part: Sized {
    fn cut(self, mid: usize) -> (Self, Self);
}

impl Part for &mut [f32] {
    fn cut(self, mid: usize) -> (Self, Self) {
        self.split_at_mut(mid)
    }
}

impl Part for &[f32] {
    fn cut(self, mid: usize) -> (Self, Self) {
        self.split_at(mid)
    }
}

impl Part for LowPrecision<'_> {
    fn cut(self, mid: usize) -> (Self, Self) {
        self.split_at(mid)
    }
}

/// A tile type over its fields (the first one's length is the tile's), each cut at `mid`.
macro_rules! tile {
    ($t:ident { $first:ident $(, $f:ident)* }) => {
        impl Tile for $t<'_> {
            fn len(&self) -> usize {
                self.$first.len()
            }

            fn split_at(self, mid: usize) -> (Self, Self) {
                let $first = self.$first.cut(mid);
                $(let $f = self.$f.cut(mid);)*
                ($t { $first: $first.0 $(, $f: $f.0)* }, $t { $first: $first.1 $(, $f: $f.1)* })
            }
        }
    };
}

/// Adam's slices.
pub(super) struct AdamTile<'a> {
    pub p: &'a mut [f32],
    pub g: &'a [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub lp: LowPrecision<'a>,
}

/// Slices of an optimizer with one state buffer `s`: SGD's momentum, Lion's moment.
pub(super) struct StateTile<'a> {
    pub p: &'a mut [f32],
    pub g: &'a [f32],
    pub s: &'a mut [f32],
    pub lp: LowPrecision<'a>,
}

/// LAMB's second pass: the weights and the two moments it reads.
pub(super) struct LambTile<'a> {
    pub p: &'a mut [f32],
    pub m: &'a [f32],
    pub v: &'a [f32],
    pub lp: LowPrecision<'a>,
}

tile!(AdamTile { p, g, m, v, lp });
tile!(StateTile { p, g, s, lp });
tile!(LambTile { p, m, v, lp });
