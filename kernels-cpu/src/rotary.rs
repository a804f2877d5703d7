//! Rotary position embedding for `x[batch, seq, heads, head_dim]` with
//! `cos`, `sin` of shape `[seq, rotary_dim / 2]`.
//!
//! The first `rotary_dim` dims of each head are rotated in pairs by the angle of
//! their position and frequency; dims from `rotary_dim` on pass through.
//! - Non-interleaved (GPT-NeoX, Llama): pair `(i, i + rotary_dim/2)`.
//! - Interleaved (GPT-J): pair `(2i, 2i + 1)`.
//!
//! Each pair `(a, b)` becomes `(a cos - b sin, b cos + a sin)`, computed in
//! `T::Acc` and rounded once. The backward is the rotation by the opposite
//! angle (`sin` negated), which [`apply`] does with `inverse = true`.
//!
//! [`apply_strided`] reads an `x` whose batch, seq and heads dims have any
//! strides (each head contiguous): `q` and `k` sliced from a fused qkv
//! projection, or a `[batch, heads, seq, head_dim]` tensor transposed to this
//! layout, with no copy; its output is contiguous. [`apply_inplace`]
//! rotates such an `x` in place (vLLM's form).
use crate::element::{Acc, Element};
use crate::error::{check_len, Error, Result};
use crate::layout::RowLayout;
use crate::par::Par;
use crate::rows::{Blocks, Order, Split};
use crate::simd::{dispatch, prefetch_part, prefetch_row_write_ahead, writes_ahead};

#[cfg(target_arch = "x86_64")]
mod avx2_bf16;
mod wide;

/// The shape of a call: `x` is `[batch, seq, heads, head_dim]`, `cos`/`sin` are
/// `[seq, rotary_dim / 2]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Batch size.
    pub batch: usize,
    /// Sequence length (positions).
    pub seq: usize,
    /// Heads.
    pub heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Rotated elements per head: even, at most `head_dim`.
    pub rotary_dim: usize,
}

impl Shape {
    /// Elements of `x`.
    pub fn numel(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }

    /// The strides of a contiguous `x`.
    pub fn contiguous(&self) -> Strides {
        Strides { batch: self.seq * self.heads * self.head_dim, seq: self.heads * self.head_dim, heads: self.head_dim }
    }

    /// Elements a slice must hold for `x` laid out with `strides`: one past
    /// the last element (0 when `x` is empty); `None` on overflow.
    pub fn span(&self, strides: Strides) -> Option<usize> {
        // The heads as rows of head_dim: three leading dims always fit a RowLayout.
        let sizes = [self.batch, self.seq, self.heads];
        RowLayout::new(&sizes, &[strides.batch, strides.seq, strides.heads])?.span(self.head_dim)
    }

    /// [`Shape::check`] for an `x` laid out with `strides`: its slice must hold
    /// at least [`Shape::span`] elements.
    pub fn check_strided(
        &self,
        op: &'static str,
        x: usize,
        strides: Strides,
        cos: usize,
        sin: usize,
        out: usize,
    ) -> Result<()> {
        self.check(op, self.numel(), cos, sin, out)?;
        match self.span(strides) {
            Some(span) if x >= span => Ok(()),
            Some(span) => Err(Error::Shape {
                op,
                arg: "x",
                msg: format!("holds {x} elements, but its shape and strides {strides} reach {span}"),
            }),
            None => Err(Error::Shape { op, arg: "x", msg: format!("strides {strides} overflow the address space") }),
        }
    }

    /// Checks that no two rows (heads) of an `x` laid out with `strides`
    /// share an element, as writing `x` in place needs: taken by increasing
    /// stride, each dim of more than one entry must step past everything
    /// inside it. (A layout that interleaves its rows without overlap is
    /// refused too; torch makes none.)
    pub fn check_disjoint(&self, op: &'static str, strides: Strides) -> Result<()> {
        if self.numel() == 0 {
            return Ok(());
        }
        let mut dims = [(self.batch, strides.batch), (self.seq, strides.seq), (self.heads, strides.heads)];
        dims.sort_by_key(|&(_, s)| s);
        let mut extent = self.head_dim;
        for (n, s) in dims {
            if n <= 1 || extent == 0 {
                continue;
            }
            if s < extent {
                let msg = format!("has heads that overlap (strides {strides}), which an in-place op cannot write");
                return Err(Error::Shape { op, arg: "x", msg });
            }
            extent = s.saturating_mul(n - 1).saturating_add(extent);
        }
        Ok(())
    }

    /// Checks `rotary_dim` and the slice lengths, naming `op` and the argument.
    pub fn check(&self, op: &'static str, x: usize, cos: usize, sin: usize, out: usize) -> Result<()> {
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return Err(Error::Shape {
                op,
                arg: "cos",
                msg: format!(
                    "gives rotary_dim = {} (2 x its last dim), which must be even and at most head_dim = {}",
                    self.rotary_dim, self.head_dim
                ),
            });
        }
        check_len(op, "x", x, self.numel())?;
        check_len(op, "cos", cos, self.seq * self.rotary_dim / 2)?;
        check_len(op, "sin", sin, self.seq * self.rotary_dim / 2)?;
        check_len(op, "out", out, self.numel())
    }
}

/// Element strides of `x`'s first three dims; its last dim (`head_dim`) is
/// contiguous. Heads may overlap or repeat (a stride of 0 broadcasts): `x` is
/// only read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Between batch entries.
    pub batch: usize,
    /// Between positions.
    pub seq: usize,
    /// Between heads.
    pub heads: usize,
}

/// `[batch, seq, heads, 1]`: `x.stride()`, as the other messages give strides.
impl std::fmt::Display for Strides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {}, {}, 1]", self.batch, self.seq, self.heads)
    }
}

/// Writes the rotation of `x` to `out` (by the opposite angle when `inverse`:
/// the backward, applied to the output gradient).
#[allow(clippy::too_many_arguments)]
pub fn apply<T: Element>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    out: &mut [T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
    par: Par<'_>,
) -> Result<()> {
    let op = if inverse { "rotary_embedding_backward" } else { "rotary_embedding" };
    shape.check(op, x.len(), cos.len(), sin.len(), out.len())?;
    run(x, shape.contiguous(), cos, sin, out, shape, interleaved, inverse, par);
    Ok(())
}

/// [`apply`] for an `x` laid out with `strides` (see [`Strides`]); `out` is
/// contiguous. `x` must hold at least [`Shape::span`] elements.
#[allow(clippy::too_many_arguments)]
pub fn apply_strided<T: Element>(
    x: &[T],
    strides: Strides,
    cos: &[T],
    sin: &[T],
    out: &mut [T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
    par: Par<'_>,
) -> Result<()> {
    let op = if inverse { "rotary_embedding_backward" } else { "rotary_embedding" };
    shape.check_strided(op, x.len(), strides, cos.len(), sin.len(), out.len())?;
    run(x, strides, cos, sin, out, shape, interleaved, inverse, par);
    Ok(())
}

/// Rotates `x` in place (by the opposite angle when `inverse`): vLLM's form,
/// which allocates nothing. `x` is laid out with `strides` (see [`Strides`];
/// `shape.contiguous()` for a contiguous one), whose heads must not overlap
/// ([`Shape::check_disjoint`]). The same bits as [`apply_strided`]'s output.
/// Rows are visited in the order they lie in memory (a transposed layout
/// too; there, where bf16 or f16 angles are widened, in tiles of positions),
/// each rotated in place where bf16 runs on AVX2 (the `avx2_bf16` module), else
/// copied to a buffer first and rotated back into place.
#[allow(clippy::too_many_arguments)]
pub fn apply_inplace<T: Element>(
    x: &mut [T],
    strides: Strides,
    cos: &[T],
    sin: &[T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
    par: Par<'_>,
) -> Result<()> {
    let op = if inverse { "rotary_embedding_backward_" } else { "rotary_embedding_" };
    shape.check_strided(op, x.len(), strides, cos.len(), sin.len(), shape.numel())?;
    shape.check_disjoint(op, strides)?;
    let d = shape.head_dim;
    let rows = shape.batch * shape.seq * shape.heads;
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let sign = if inverse { T::Acc::ZERO - T::Acc::ONE } else { T::Acc::ONE };
    // (entries, stride, is the position dim), outermost (largest stride) first.
    let mut dims =
        [(shape.batch, strides.batch, false), (shape.seq, strides.seq, true), (shape.heads, strides.heads, false)];
    dims.sort_by_key(|&(_, s, _)| std::cmp::Reverse(s));
    let pos_dim = dims.iter().position(|&(_, _, p)| p).unwrap_or(1);
    let [(_, s0, _), (n1, s1, _), (n2, s2, _)] = dims;
    let base = RowsPtr(x.as_mut_ptr());
    let blocks = Blocks::new(&par, rows, d);
    // Positions innermost (a `[batch, heads, seq, head_dim]` x transposed):
    // rows in memory order would go through every position once per head,
    // each widening its angles again; tiles of TILE positions, stream by
    // stream (a stream: one head's positions), widen them once per tile.
    // Where no angles are widened (f32, f64; bf16 without AVX512-BF16) there
    // is nothing to share, and memory order is faster: f32 4x1024x32x128 on
    // a 2-core AMD EPYC (Zen 4), criterion, alternated runs, 4.2-4.6 ms
    // against 5.7-6.6 in tiles (docs/BENCHMARKS.md, session 39).
    let tiled = pos_dim == 2 && n2 > 1 && wide::applies::<T>();
    par.for_each(blocks.count, &|b| {
        let rows = blocks.rows(b);
        dispatch(
            #[inline(always)]
            || {
                let mut buf = vec![T::default(); d];
                let mut rot = Rotator::new(cos, sin, shape, interleaved, sign, if tiled { TILE } else { 1 });
                let at_rows = (&base, [s0, s1, s2], d, pos_dim);
                // SAFETY (both): check_strided put every row inside `x`, and
                // check_disjoint made rows pairwise disjoint; blocks own
                // disjoint ranges of rows, and each block visits its own once.
                if tiled {
                    let (streams, end) = (rows.start / n2..(rows.end - 1) / n2 + 1, rows.end);
                    let coords = (0..n2).step_by(TILE).flat_map(|t| {
                        streams.clone().flat_map(move |st| {
                            let first = (st * n2 + t).max(rows.start);
                            (first..(st * n2 + (t + TILE).min(n2)).min(end))
                                .map(move |r| [st / n1, st % n1, r - st * n2])
                        })
                    });
                    unsafe { rotate_inplace(at_rows, &mut rot, &mut buf, coords) };
                    return;
                }
                let r = rows.start;
                let coords = rows.clone().scan([r / (n1 * n2), (r / n2) % n1, r % n2], |at, _| {
                    let now = *at;
                    next_row(at, n1, n2);
                    Some(now)
                });
                unsafe { rotate_inplace(at_rows, &mut rot, &mut buf, coords) };
            },
        );
    });
    Ok(())
}

/// [`apply_inplace`]'s rows at `coords` (entries of its three dims sorted by
/// stride, `strides` theirs, `pos_dim` the position's), each rotated in
/// place ([`Rotator::row_in_place`], `buf` one row long).
///
/// # Safety
/// Every row at `coords` lies inside the slice behind `base`, no two are
/// the same or overlap, and no other reference to them lives meanwhile.
#[inline(always)]
unsafe fn rotate_inplace<T: Element>(
    (base, strides, d, pos_dim): (&RowsPtr<T>, [usize; 3], usize, usize),
    rot: &mut Rotator<'_, T>,
    buf: &mut [T],
    coords: impl Iterator<Item = [usize; 3]>,
) {
    for at in coords {
        // SAFETY: the caller's.
        let row = unsafe { base.row(at[0] * strides[0] + at[1] * strides[1] + at[2] * strides[2], d) };
        rot.row_in_place(at[pos_dim], row, buf);
    }
}

/// `x`'s first element, shared by the tasks of [`apply_inplace`], each of
/// which writes its own rows.
struct RowsPtr<T>(*mut T);

// SAFETY: the tasks write disjoint rows (see apply_inplace); T is Send.
unsafe impl<T: Send> Sync for RowsPtr<T> {}

impl<T> RowsPtr<T> {
    /// The `len` elements from `offset`.
    ///
    /// # Safety
    /// They must lie inside the slice this points into, and no other
    /// reference to them may live while the result does.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, offset: usize, len: usize) -> &mut [T] {
        // SAFETY: per this function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), len) }
    }
}

/// [`apply_strided`] after its checks.
#[allow(clippy::too_many_arguments)]
fn run<T: Element>(
    x: &[T],
    st: Strides,
    cos: &[T],
    sin: &[T],
    out: &mut [T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
    par: Par<'_>,
) {
    let (d, heads, seq) = (shape.head_dim, shape.heads, shape.seq);
    let rows = shape.batch * seq * heads;
    if rows == 0 || d == 0 {
        return;
    }
    let sign = if inverse { T::Acc::ZERO - T::Acc::ONE } else { T::Acc::ONE };
    let blocks = Blocks::new(&par, rows, d);
    let ys = Split::new(out, blocks.per * d);
    // Heads farther apart in x than positions (a [batch, heads, seq, head_dim]
    // tensor transposed): rows in output order would read `heads` streams
    // at once, one head from each; tiles of TILE tokens read TILE consecutive
    // rows of each head instead.
    let tiled = heads > 1 && seq > 1 && st.heads > st.seq;
    par.for_each(blocks.count, &|b| {
        let (mut y, order) = if tiled { ys.get_descending_on_huge(b) } else { (ys.get(b), Order::Ascending) };
        let rows = blocks.rows(b);
        dispatch(
            #[inline(always)]
            || {
                if tiled {
                    let mut rot = Rotator::new(cos, sin, shape, interleaved, sign, TILE);
                    rotate_tiles(x, st, &mut rot, &mut y, rows.clone(), shape, order);
                    return;
                }
                let mut rot = Rotator::new(cos, sin, shape, interleaved, sign, 1);
                // The row's batch entry, position and head, stepped
                // ([`next_row`]) rather than divided out per row (a division is about as long as
                // rotating a bf16 head of 128).
                let start = rows.start;
                let mut at = [start / (seq * heads), (start / heads) % seq, start % heads];
                // A contiguous x is read row after row: each row asks for
                // the one PREFETCH_BYTES ahead (see there).
                let contiguous = st == shape.contiguous();
                let ahead_rows = (PREFETCH_BYTES / (d * std::mem::size_of::<T>())).max(1);
                // And asks for the output's lines ahead of its stores
                // (Intel's AVX-512: `writes_ahead`): on the Xeon, [4, 1024,
                // 32, 128], two threads, interleaved medians (session 62),
                // f32 into reused outputs 3.73 -> 3.15-3.32 ms, into fresh
                // huge pages 1-4% faster; bf16 into reused outputs unchanged
                // (1.52 ms), into fresh huge pages 4.41 -> 4.23.
                let ahead_w = writes_ahead();
                for (i, y) in y.chunks_exact_mut(d).enumerate() {
                    if contiguous {
                        let ahead = x.get((start + i + ahead_rows) * d..).unwrap_or(&[]);
                        prefetch_part::<T, false>(ahead, 0, d);
                    }
                    if ahead_w {
                        prefetch_row_write_ahead(y);
                    }
                    let [batch, pos, head] = at;
                    rot.row(pos, &x[batch * st.batch + pos * st.seq + head * st.heads..][..d], y);
                    next_row(&mut at, seq, heads);
                }
            },
        );
    });
}

/// Steps `at`, the entries of a row in three dims (the middle one of `n1`
/// entries, the inner one of `n2`), to the next row: the inner entry first.
#[inline(always)]
fn next_row(at: &mut [usize; 3], n1: usize, n2: usize) {
    at[2] += 1;
    if at[2] == n2 {
        at[2] = 0;
        at[1] += 1;
        if at[1] == n1 {
            at[1] = 0;
            at[0] += 1;
        }
    }
}

/// How far ahead of the row being rotated a contiguous `x` is prefetched.
/// Through torch with transparent huge pages (a fresh output, whose first
/// store to each 2 MiB page zeroes it all), f32 NeoX `[4, 1024, 32, 128]`
/// took 1.09-1.10x a clone of `x` without it and 1.00-1.03x with it
/// (alternated runs; 1, 2, 4 and 8 KiB ahead all within that); bf16 was
/// unchanged at 1.17-1.21x.
const PREFETCH_BYTES: usize = 2048;

/// Tokens per tile of [`rotate_tiles`] (and positions per tile of
/// [`apply_inplace`] where they are innermost): 16 rows of 128 bf16 are 4
/// KiB read in a row from each head.
const TILE: usize = 16;

/// Output rows `rows` (`y` holds them) in tiles of [`TILE`] tokens, head by
/// head within a tile; the tiles in `order`, each tile's rows ascending.
///
/// A tile's rows lie together in `y` (128 KiB for bf16 heads of 128), so
/// tiles from the last store into fresh huge pages roughly from the top
/// down ([`Order`]). Through torch with THP, bf16 `[4, 1024, 32, 128]`
/// transposed, both orders interleaved in one process: 0.91-0.92 of the
/// ascending time (3.88-3.93 ms against 4.25-4.29; a clone of q
/// 3.4-3.5). With each tile's heads and tokens descending too it took 1.12
/// of it (4.60 against 4.12): each head's 16 rows are read from its last
/// down, and the next head prefetched was the one below. Unlike the row
/// kernels, the tiles gain in every type, so they descend on any fresh
/// huge pages ([`Split::get_descending_on_huge`]): f32 0.87, 0.90 and 0.91
/// of the ascending time in three runs (8.2 against 8.5 ms, 7.9 against
/// 8.9, 9.7 against 10.8; a clone of q 6.3-10.1), f16 0.91 in two;
/// without THP, where both take the ascending path, 1.00 (session 50,
/// same process, per-round ratios of 31-41 alternated rounds).
#[inline(always)]
fn rotate_tiles<T: Element>(
    x: &[T],
    st: Strides,
    rot: &mut Rotator<'_, T>,
    y: &mut [T],
    rows: std::ops::Range<usize>,
    shape: Shape,
    order: Order,
) {
    let (d, heads, seq) = (shape.head_dim, shape.heads, shape.seq);
    let tokens = rows.start / heads..(rows.end - 1) / heads + 1;
    order.each(
        tokens.len().div_ceil(TILE),
        #[inline(always)]
        |t| {
            let tile = tokens.start + t * TILE;
            let n = (tokens.end - tile).min(TILE);
            // Each token's position and where its heads start in x.
            let (mut pos, mut base) = ([0usize; TILE], [0usize; TILE]);
            for i in 0..n {
                let (b, p) = ((tile + i) / seq, (tile + i) % seq);
                (pos[i], base[i]) = (p, b * st.batch + p * st.seq);
            }
            for h in 0..heads {
                for i in 0..n {
                    let row = (tile + i) * heads + h;
                    if !rows.contains(&row) {
                        continue;
                    }
                    let at = base[i] + h * st.heads;
                    // The same token's next head, a tile's worth of rows
                    // ahead of its use: each head's rows of a tile start
                    // cold otherwise (bf16 [4, 1024, 32, 128] transposed,
                    // criterion on a Zen 4: 4.1-4.4 ms against 4.0-5.3, 5
                    // of 6 alternated pairs faster; f32 within noise).
                    if h + 1 < heads {
                        prefetch_part::<T, false>(x.get(at + st.heads..).unwrap_or(&[]), 0, d);
                    }
                    let y = &mut y[(row - rows.start) * d..][..d];
                    rot.row(pos[i], &x[at..][..d], y);
                }
            }
        },
    );
}

/// Rotates the rows of one block: the layout, the sign of the angle, and
/// for f16 and bf16 ([`wide::applies`]) the angles of the positions met,
/// widened to f32.
struct Rotator<'a, T: Element> {
    cos: &'a [T],
    sin: &'a [T],
    /// Pairs per row (`rotary_dim / 2`).
    half: usize,
    interleaved: bool,
    sign: T::Acc,
    /// Where [`wide::row_halves`] runs.
    wide: Option<Widened>,
    /// Where [`avx2_bf16`] runs (bf16 on AVX2 without AVX512-BF16).
    avx2: Avx2<T>,
}

/// [`avx2_bf16`]'s token for rows of `T`, where that code runs.
#[cfg(target_arch = "x86_64")]
type Avx2<T> = Option<avx2_bf16::Token<T>>;
/// Never one off x86-64.
#[cfg(not(target_arch = "x86_64"))]
type Avx2<T> = Option<(std::convert::Infallible, std::marker::PhantomData<T>)>;

/// The token where [`avx2_bf16`] runs for `T`.
#[inline(always)]
fn avx2_token<T: 'static>() -> Avx2<T> {
    #[cfg(target_arch = "x86_64")]
    return avx2_bf16::Token::new();
    #[cfg(not(target_arch = "x86_64"))]
    None
}

impl<'a, T: Element> Rotator<'a, T> {
    /// For rows of `shape`, keeping the widened angles of up to `slots`
    /// positions (as many as a block visits in turn: one where rows go
    /// position by position, [`TILE`] for tiles).
    #[inline(always)]
    fn new(cos: &'a [T], sin: &'a [T], shape: Shape, interleaved: bool, sign: T::Acc, slots: usize) -> Self {
        let half = shape.rotary_dim / 2;
        let wide = (half > 0 && wide::applies::<T>()).then(|| Widened::new(half, interleaved, slots));
        Rotator { cos, sin, half, interleaved, sign, wide, avx2: avx2_token() }
    }

    /// Rotates `row` (one head) by the angles of position `pos` in place:
    /// directly where [`avx2_bf16`] runs, else copied to `buf` (as long)
    /// first and rotated back ([`Rotator::row`]).
    #[inline(always)]
    fn row_in_place(&mut self, pos: usize, row: &mut [T], buf: &mut [T]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(t) = self.avx2 {
            let (c, s) = self.angles(pos);
            if self.interleaved {
                avx2_bf16::pairs_in_place(t, row, c, s, self.sign);
            } else {
                avx2_bf16::halves_in_place(t, row, c, s, self.sign);
            }
            return;
        }
        buf.copy_from_slice(row);
        self.row(pos, buf, row);
    }

    /// Position `pos`'s cos and sin, as given.
    #[inline(always)]
    fn angles(&self, pos: usize) -> (&'a [T], &'a [T]) {
        let half = self.half;
        (&self.cos[pos * half..][..half], &self.sin[pos * half..][..half])
    }

    /// Rotates `x` (one head) by the angles of position `pos` into `y`, and
    /// copies the dims past the rotated ones.
    #[inline(always)]
    fn row(&mut self, pos: usize, x: &[T], y: &mut [T]) {
        let (half, sign) = (self.half, self.sign);
        match &mut self.wide {
            Some(w) => {
                let (c, s) = w.get(pos, self.cos, self.sin, sign);
                let (x, y) = (&x[..2 * half], &mut y[..2 * half]);
                if self.interleaved {
                    wide::row_pairs(x, y, c, s);
                } else {
                    wide::row_halves(x, y, c, s);
                }
            }
            None => {
                let (c, s) = self.angles(pos);
                if self.interleaved {
                    rotate_pairs(self.avx2, x, y, c, s, sign);
                } else {
                    rotate_halves(self.avx2, x, y, c, s, sign);
                }
            }
        }
        if 2 * half < y.len() {
            y[2 * half..].copy_from_slice(&x[2 * half..]);
        }
    }
}

/// The cos and sin (times the sign) of up to `slots` positions in f32, each
/// widened once when first met and kept in slot `pos % slots`. The heads of
/// a token share them; widening them in every head took five of bf16's
/// ~25 vector instructions per 16 pairs (two values widened in two each,
/// and the multiply by the sign). For the GPT-J layout they are laid out
/// per value, as [`wide::row_pairs`] takes them: `[c0, c0, c1, c1, ..]` and
/// `[-s0, s0, -s1, s1, ..]`.
struct Widened {
    half: usize,
    interleaved: bool,
    /// The position each slot holds (`usize::MAX`: none yet).
    pos: Vec<usize>,
    /// Each slot's cos, then its sin times the sign.
    cs: Vec<f32>,
}

impl Widened {
    fn new(half: usize, interleaved: bool, slots: usize) -> Self {
        let slots = slots.max(1);
        let cs = vec![0.0; Self::slot_len(half, interleaved) * slots];
        Widened { half, interleaved, pos: vec![usize::MAX; slots], cs }
    }

    /// f32 values per slot: cos and sin, each `half` long, or `2 half`
    /// per value (GPT-J).
    fn slot_len(half: usize, interleaved: bool) -> usize {
        if interleaved {
            4 * half
        } else {
            2 * half
        }
    }

    /// Position `pos`'s cos and sin times `sign`, widened from `cos` and
    /// `sin` (`[seq, half]`) when its slot holds another.
    #[inline(always)]
    fn get<T: Element>(&mut self, pos: usize, cos: &[T], sin: &[T], sign: T::Acc) -> (&[f32], &[f32]) {
        let (half, k, len) = (self.half, pos % self.pos.len(), Self::slot_len(self.half, self.interleaved));
        let (c, s) = self.cs[len * k..][..len].split_at_mut(len / 2);
        if self.pos[k] != pos {
            self.pos[k] = pos;
            // `to_acc` is f32 where this runs (f16, bf16): the f64 round
            // trip changes nothing and LLVM drops it. `s * sign` and its
            // negation are exact.
            let f = |v: T| v.to_acc().to_f64() as f32;
            let sign = sign.to_f64() as f32;
            let (cos, sin) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
            if self.interleaved {
                for (i, (&cv, &sv)) in cos.iter().zip(sin).enumerate() {
                    let (cv, sv) = (f(cv), f(sv) * sign);
                    (c[2 * i], c[2 * i + 1], s[2 * i], s[2 * i + 1]) = (cv, cv, -sv, sv);
                }
            } else {
                for (w, &v) in c.iter_mut().zip(cos) {
                    *w = f(v);
                }
                for (w, &v) in s.iter_mut().zip(sin) {
                    *w = f(v) * sign;
                }
            }
        }
        (c, s)
    }
}

/// NeoX layout: `(x[i], x[i + h])` for `i < h`, in `T::Acc` (f32 and f64;
/// f16 and bf16 take [`wide::row_halves`] where it runs; bf16 on AVX2
/// without it, [`avx2_bf16::halves`] for its whole groups).
#[inline(always)]
fn rotate_halves<T: Element>(t: Avx2<T>, x: &[T], y: &mut [T], c: &[T], s: &[T], sign: T::Acc) {
    let h = c.len();
    let done = match t {
        #[cfg(target_arch = "x86_64")]
        Some(t) => avx2_bf16::halves(t, x, y, c, s, sign),
        _ => 0,
    };
    let (x1, x2) = (&x[..h], &x[h..2 * h]);
    let (y1, y2) = y[..2 * h].split_at_mut(h);
    for i in done..h {
        (y1[i], y2[i]) = turn(x1[i], x2[i], c[i], s[i], sign);
    }
}

/// GPT-J layout: `(x[2i], x[2i + 1])`, in `T::Acc` (f32 and f64; f16 and
/// bf16 take [`wide::row_pairs`] where it runs; bf16 on AVX2 without it,
/// [`avx2_bf16::pairs`] for its whole groups).
#[inline(always)]
fn rotate_pairs<T: Element>(t: Avx2<T>, x: &[T], y: &mut [T], c: &[T], s: &[T], sign: T::Acc) {
    let h = c.len();
    let done = match t {
        #[cfg(target_arch = "x86_64")]
        Some(t) => avx2_bf16::pairs(t, x, y, c, s, sign),
        _ => 0,
    };
    let (x, y) = (&x[2 * done..2 * h], &mut y[2 * done..2 * h]);
    for (((y, x), &c), &s) in y.chunks_exact_mut(2).zip(x.chunks_exact(2)).zip(&c[done..]).zip(&s[done..]) {
        (y[0], y[1]) = turn(x[0], x[1], c, s, sign);
    }
}

/// The pair `(a, b)` rotated by the angle of cosine `c` and sine `s * sign`:
/// `(a c - b s, b c + a s)` in `T::Acc`, each rounded once to `T`.
#[inline(always)]
fn turn<T: Element>(a: T, b: T, c: T, s: T, sign: T::Acc) -> (T, T) {
    let (a, b, c, s) = (a.to_acc(), b.to_acc(), c.to_acc(), s.to_acc() * sign);
    (T::from_acc(a * c - b * s), T::from_acc(b * c + a * s))
}

/// Reference in f64.
pub fn apply_ref<T: Element>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
) -> Vec<f64> {
    let (d, half) = (shape.head_dim, shape.rotary_dim / 2);
    let mut out: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    for (row, y) in out.chunks_mut(d.max(1)).enumerate() {
        let pos = (row / shape.heads) % shape.seq;
        for i in 0..half {
            let (c, s) = (cos[pos * half + i].to_f64(), sin[pos * half + i].to_f64());
            let s = if inverse { -s } else { s };
            let (ia, ib) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (a, b) = (y[ia], y[ib]);
            y[ia] = a * c - b * s;
            y[ib] = b * c + a * s;
        }
    }
    out
}
