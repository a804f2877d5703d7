//! Where the rows of an input read through its strides start.
//!
//! A row op sees its input as `rows` rows of `cols` contiguous elements. A
//! strided view (q sliced from a fused qkv projection and viewed as
//! `[tokens, heads, head_dim]`, a transposed tensor, a broadcast batch) keeps
//! each row contiguous but puts the rows anywhere: [`RowLayout`] says where,
//! from the leading dims' sizes and strides. Dims that are contiguous with
//! each other merge, so most views need one or two; up to three are supported.
use crate::error::{Error, Result};

/// The leading dims of a row input (every dim but the last), merged where
/// contiguous with each other, outermost first, padded in front with dims of
/// size 1; row `r`'s offset is `sum(i_k * strides[k])` for its index `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    sizes: [usize; 3],
    strides: [usize; 3],
}

impl RowLayout {
    /// Leading dims a layout can hold after merging.
    pub const MAX_DIMS: usize = 3;

    /// `rows` rows of `cols`, back to back.
    pub fn contiguous(rows: usize, cols: usize) -> RowLayout {
        RowLayout { sizes: [1, 1, rows], strides: [0, 0, cols] }
    }

    /// From the sizes and strides (in elements) of the leading dims, outermost
    /// first. Dims of size 1 are dropped and neighbours merge where the outer
    /// stride is the inner one times the inner size; `None` where more than
    /// [`RowLayout::MAX_DIMS`] remain, or the lengths differ.
    pub fn new(sizes: &[usize], strides: &[usize]) -> Option<RowLayout> {
        if sizes.len() != strides.len() {
            return None;
        }
        if sizes.contains(&0) {
            return Some(RowLayout::contiguous(0, 0));
        }
        // Innermost first while merging.
        let mut dims: Vec<(usize, usize)> = Vec::with_capacity(sizes.len());
        for (&n, &s) in sizes.iter().zip(strides).rev().filter(|(&n, _)| n != 1) {
            match dims.last_mut() {
                Some((inner_n, inner_s)) if inner_s.checked_mul(*inner_n) == Some(s) => *inner_n *= n,
                _ => dims.push((n, s)),
            }
        }
        if dims.len() > Self::MAX_DIMS {
            return None;
        }
        let mut layout = RowLayout { sizes: [1; 3], strides: [0; 3] };
        for (k, (n, s)) in dims.into_iter().enumerate() {
            layout.sizes[2 - k] = n;
            layout.strides[2 - k] = s;
        }
        Some(layout)
    }

    /// The merged sizes, outermost first (leading ones 1).
    pub fn sizes(&self) -> [usize; 3] {
        self.sizes
    }

    /// The merged strides in elements, outermost first (0 for a padding dim).
    pub fn strides(&self) -> [usize; 3] {
        self.strides
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.sizes.iter().product()
    }

    /// Whether the rows lie back to back, `cols` apart, from offset 0.
    pub fn is_contiguous(&self, cols: usize) -> bool {
        self.rows() <= 1 || (self.sizes[0] == 1 && self.sizes[1] == 1 && self.strides[2] == cols)
    }

    /// Elements a slice must hold: one past the last row's last element (0
    /// when nothing is read: no rows, or rows of no elements); `None` on
    /// overflow.
    pub fn span(&self, cols: usize) -> Option<usize> {
        if self.rows() == 0 || cols == 0 {
            return Some(0);
        }
        let last = self
            .sizes
            .iter()
            .zip(self.strides)
            .try_fold(0usize, |acc, (&n, s)| acc.checked_add((n - 1).checked_mul(s)?))?;
        last.checked_add(cols)
    }

    /// Checks that a slice of `len` elements holds the rows (see
    /// [`RowLayout::span`]), naming `op` and `arg`.
    pub fn check_len(&self, op: &'static str, arg: &'static str, len: usize, cols: usize) -> Result<()> {
        match self.span(cols) {
            Some(span) if len >= span => Ok(()),
            Some(span) => Err(Error::Shape {
                op,
                arg,
                msg: format!("holds {len} elements, but its layout {self:?} reaches {span}"),
            }),
            None => Err(Error::Shape { op, arg, msg: format!("layout {self:?} overflows the address space") }),
        }
    }

    /// Offset of row `r`'s first element.
    pub fn offset(&self, r: usize) -> usize {
        let i2 = r % self.sizes[2];
        let t = r / self.sizes[2];
        let (i1, i0) = (t % self.sizes[1], t / self.sizes[1]);
        i0 * self.strides[0] + i1 * self.strides[1] + i2 * self.strides[2]
    }

    /// The offsets of rows `r`, `r + 1`, ..., stepped rather than divided.
    pub fn offsets_from(&self, r: usize) -> Offsets {
        let i2 = r % self.sizes[2];
        let t = r / self.sizes[2];
        Offsets { layout: *self, idx: [t / self.sizes[1], t % self.sizes[1], i2], off: self.offset(r) }
    }
}

/// A row index and its offset, stepped one row at a time (see
/// [`RowLayout::offsets_from`]).
#[derive(Debug, Clone)]
pub struct Offsets {
    layout: RowLayout,
    idx: [usize; 3],
    off: usize,
}

impl Offsets {
    /// The current row's offset.
    #[inline(always)]
    pub fn get(&self) -> usize {
        self.off
    }

    /// Moves to the next row.
    #[inline(always)]
    pub fn advance(&mut self) {
        let (n, s) = (self.layout.sizes, self.layout.strides);
        self.idx[2] += 1;
        self.off += s[2];
        if self.idx[2] == n[2] {
            self.idx[2] = 0;
            self.idx[1] += 1;
            self.off = self.off - n[2] * s[2] + s[1];
            if self.idx[1] == n[1] {
                self.idx[1] = 0;
                self.idx[0] += 1;
                self.off = self.off - n[1] * s[1] + s[0];
            }
        }
    }

    /// The offsets from `k` rows further on.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn skip(&self, k: usize) -> Offsets {
        self.layout.offsets_from(self.row() + k)
    }

    /// The current row's index.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn row(&self) -> usize {
        let n = self.layout.sizes;
        (self.idx[0] * n[1] + self.idx[1]) * n[2] + self.idx[2]
    }

    /// Moves to the row before; panics at the first row.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn retreat(&mut self) {
        let (n, s) = (self.layout.sizes, self.layout.strides);
        if self.idx[2] > 0 {
            self.idx[2] -= 1;
        } else {
            self.idx[2] = n[2] - 1;
            if self.idx[1] > 0 {
                self.idx[1] -= 1;
            } else {
                self.idx[1] = n[1] - 1;
                self.idx[0] = self.idx[0].checked_sub(1).expect("Offsets::retreat: before the first row");
            }
        }
        self.off = self.idx[0] * s[0] + self.idx[1] * s[1] + self.idx[2] * s[2];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets of every row by brute force over the unmerged dims.
    fn brute(sizes: &[usize], strides: &[usize]) -> Vec<usize> {
        let mut out = vec![0usize];
        for (&n, &s) in sizes.iter().zip(strides) {
            out = out.iter().flat_map(|&o| (0..n).map(move |i| o + i * s)).collect();
        }
        out
    }

    #[test]
    fn merges_contiguous_dims_and_drops_ones() {
        // A contiguous [2, 3, 4, 8]: one dim of 24 rows, 8 apart.
        assert_eq!(RowLayout::new(&[2, 3, 4], &[96, 32, 8]), Some(RowLayout::contiguous(24, 8)));
        assert!(RowLayout::new(&[2, 3, 4], &[96, 32, 8]).unwrap().is_contiguous(8));
        // q of a fused qkv [t, 3 h d] viewed [t, h, d]: two dims.
        let q = RowLayout::new(&[5, 4], &[3 * 4 * 16, 16]).unwrap();
        assert_eq!((q.sizes(), q.strides()), ([1, 5, 4], [0, 192, 16]));
        assert!(!q.is_contiguous(16));
        // Size-1 dims vanish whatever their stride.
        assert_eq!(RowLayout::new(&[1, 6, 1], &[7, 8, 999]), Some(RowLayout::contiguous(6, 8)));
        // Four dims that do not merge are too many; an empty one has no rows.
        assert_eq!(RowLayout::new(&[2, 2, 2, 2], &[1000, 100, 10, 1]), None);
        assert_eq!(RowLayout::new(&[2, 0, 3], &[5, 5, 5]).unwrap().rows(), 0);
        assert_eq!(RowLayout::new(&[2], &[1, 2]), None);
    }

    #[test]
    fn offsets_match_brute_force() {
        let cases: [(&[usize], &[usize]); 5] = [
            (&[3, 4], &[100, 9]),
            (&[2, 3, 5], &[0, 40, 8]),
            (&[4, 1, 3, 2], &[60, 7, 20, 10]),
            (&[7], &[3]),
            (&[2, 3, 4], &[5, 40, 10]),
        ];
        for (sizes, strides) in cases {
            let l = RowLayout::new(sizes, strides).unwrap();
            let want = brute(sizes, strides);
            assert_eq!(l.rows(), want.len());
            assert_eq!((0..l.rows()).map(|r| l.offset(r)).collect::<Vec<_>>(), want, "{sizes:?} {strides:?}");
            for start in 0..l.rows() {
                let mut o = l.offsets_from(start);
                for w in &want[start..] {
                    assert_eq!(o.get(), *w);
                    o.advance();
                }
                // Back down from the last row, as a descending kernel walks.
                let mut o = l.offsets_from(start).skip(l.rows() - 1 - start);
                for (i, w) in want[start..].iter().enumerate().rev() {
                    assert_eq!(o.get(), *w, "{sizes:?} {strides:?} start {start} row {i}");
                    if i > 0 {
                        o.retreat();
                    }
                }
            }
            assert_eq!(l.span(4), Some(want.iter().max().unwrap() + 4));
        }
        assert_eq!(RowLayout::new(&[2, 3], &[usize::MAX, 1]).unwrap().span(1), None);
        // Rows of no elements read nothing, wherever they start.
        assert_eq!(RowLayout::new(&[3, 2], &[2, 8]).unwrap().span(0), Some(0));
    }
}
