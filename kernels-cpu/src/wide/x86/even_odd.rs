//! The even/odd order of [`Lanes::load_pair_unordered`] for f32 rows kept
//! beside bf16 pairs on AVX2 (softmax's widened row, rms_norm's `dw`
//! partial sums, [`Lanes::store_bf16_pair_normal_even_odd`]'s default):
//! each whole group of `2 N` values as its `N` even values, then its `N`
//! odd ones.
#[cfg(doc)]
use super::Lanes;

/// Puts each whole group of `g` values of `w` (from its start) in the
/// even/odd order: the group's even values, then its odd ones, as
/// [`Lanes::load_pair_unordered`] holds `g = 2 N` bf16 values. For f32 rows
/// kept beside such pairs (softmax's widened row, a norm's `dw` partial
/// sums); the last `< g` values stay in order, and `g` 0 changes nothing.
/// [`from_even_odd`] undoes it.
pub(crate) fn to_even_odd(w: &mut [f32], g: usize) {
    reorder_groups(w, g, |group, t| {
        let (even, odd) = group.split_at_mut(g / 2);
        for k in 0..g / 2 {
            (even[k], odd[k]) = (t[2 * k], t[2 * k + 1]);
        }
    });
}

/// Puts each whole group of `g` values of `w` in the even/odd order (of
/// [`to_even_odd`]) back in order.
pub(crate) fn from_even_odd(w: &mut [f32], g: usize) {
    reorder_groups(w, g, |group, t| {
        let (even, odd) = t.split_at(g / 2);
        for k in 0..g / 2 {
            (group[2 * k], group[2 * k + 1]) = (even[k], odd[k]);
        }
    });
}

/// Calls `f(group, copy)` on each whole group of `g` values of `w`, with
/// a copy of the group as it was; nothing where `g` is 0. Not for hot
/// loops: once per row or per block of rows.
fn reorder_groups(w: &mut [f32], g: usize, f: impl Fn(&mut [f32], &[f32])) {
    if g == 0 {
        return;
    }
    assert!(g.is_multiple_of(2) && g <= 64, "reorder_groups: groups of {g}");
    let mut t = [0f32; 64];
    for group in w.chunks_exact_mut(g) {
        t[..g].copy_from_slice(group);
        f(group, &t[..g]);
    }
}

#[cfg(test)]
mod tests {
    use super::{from_even_odd, to_even_odd};

    /// Each whole group becomes its even values then its odd ones, the
    /// rest stays, and `from_even_odd` undoes it; groups of 0 change
    /// nothing.
    #[test]
    fn even_odd_groups_and_back() {
        let w: Vec<f32> = (0..37).map(|i| i as f32).collect();
        for g in [0usize, 2, 16, 32] {
            let mut v = w.clone();
            to_even_odd(&mut v, g);
            let whole = w.len().checked_div(g).map_or(0, |k| k * g);
            let mut want = Vec::new();
            for group in w[..whole].chunks(g.max(1)) {
                want.extend(group.iter().step_by(2));
                want.extend(group.iter().skip(1).step_by(2));
            }
            want.extend(&w[whole..]);
            assert_eq!(v, want, "g={g}");
            from_even_odd(&mut v, g);
            assert_eq!(v, w, "g={g}: back");
        }
    }
}
