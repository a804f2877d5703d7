//! Faulting in a fresh output's pages in bulk before the kernel writes it.
//!
//! An op's output is usually a new allocation, and a large one comes straight
//! from `mmap`: its pages do not exist until the first store to each, and each
//! 4 KiB page then costs a trap into the kernel. Asking Linux to populate the
//! whole range with `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) does the same
//! work (allocate and zero each page) in one call without the traps; measured
//! on the 2-core CI machine, writing 32 MiB into fresh memory from two threads
//! took 3.2-3.5 ms with it against 5.5-6.3 ms without, and rms_norm over a
//! fresh 4096x4096 output ran 1.2-1.5x faster.
//!
//! Whether an output of up to 2 MiB (`SCAN_PAGES` pages) is fresh is decided
//! once per output ([`fresh`], one `mincore` call over all its pages), before
//! it is cut into blocks; only then is each block populated ([`prefault`],
//! which probes its own pages again, since a fresh output may lie partly on
//! pages that are already there). Larger outputs leave it to each block, as
//! all outputs did before. Probing every block of an output that is already
//! in memory (the usual case for outputs under glibc's `mmap` threshold,
//! reused from the heap), three `mincore` calls a block at 1.5 us each on
//! the CI machine, cost more than the kernel at decode sizes: rms_norm f32 `[64, 4096]` through torch took 61-80 us
//! that way, against 45-49 us with one probe per output.
//!
//! Memory with transparent huge pages already faults once per 2 MiB, and
//! there zeroing a whole block ahead of the stores only pushes the zeroed
//! lines out of cache (2-13% slower, measured), so such memory is detected
//! (one page is faulted in, and its neighbour checked) and left alone. So is
//! memory that is already there, such as a reused output buffer.
//!
//! [`prefault`] also says what it found ([`Pages`]), so that a kernel can
//! write a block on fresh huge pages from its last row down
//! ([`Order::Descending`](crate::rows::Order)): Linux zeroes each huge page
//! at its first store, leaving the lines it zeroed last in cache, and a
//! kernel that stores into those first finds more of them there. Where the
//! caller writes that way, the huge-page probe faults the top page of the
//! block's last whole 2 MiB frame, so that the top of the frame is zeroed
//! last (Linux 6.x zeroes a huge page about the faulting address last).
//!
//! It changes no byte of memory: a page that is already there is left as it
//! is, and a new page is zeroed, which is what the first store would have
//! found. Only pages wholly inside the slice are touched. Where the call is
//! refused nothing is done; after an `EINVAL` (a kernel before 5.14, or a
//! mapping of device memory) it is not tried again. Other systems: a no-op.

/// Slices shorter than this are left to fault on their own: the call would
/// cost more than the traps it saves.
pub(crate) const MIN_BYTES: usize = 64 << 10;

/// Whether the blocks of output `s` should be populated as they are taken:
/// `s` is large enough and some of its pages are not in memory yet (one
/// `mincore` call over all of them); for an output of more than
/// `SCAN_PAGES` pages, always, each block then probing its own pages as
/// before. False where populating is not supported. Cheap to ask once per
/// output; see the module doc.
#[inline]
pub(crate) fn fresh<T>(s: &[T]) -> bool {
    let bytes = std::mem::size_of_val(s);
    bytes >= MIN_BYTES && imp::fresh(s.as_ptr().cast::<u8>(), bytes)
}

/// What [`prefault`] found of a slice's pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pages {
    /// Already in memory, or not looked at: the slice is too small, or
    /// populating is not supported.
    Present,
    /// Some were missing; all are in memory now.
    Populated,
    /// Some were missing, on transparent huge pages: the probe faulted one
    /// in, and the others fault as the kernel first stores to each.
    Huge,
}

/// Populates the pages that lie wholly inside `s`, if `s` is large enough,
/// and says what it found. With `top_first` (the caller writes `s` from its
/// end down) the huge-page probe faults in the top of the last whole 2 MiB
/// frame instead of the bottom of the first one (see the module doc).
#[inline]
pub(crate) fn prefault<T>(s: &mut [T], top_first: bool) -> Pages {
    let bytes = std::mem::size_of_val(s);
    if bytes < MIN_BYTES {
        return Pages::Present;
    }
    imp::populate(s.as_mut_ptr().cast::<u8>(), bytes, top_first)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::Pages;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Cleared once the kernel refuses `MADV_POPULATE_WRITE` as unknown.
    static SUPPORTED: AtomicBool = AtomicBool::new(true);

    /// Pages this far apart or closer, in one aligned frame, share a huge page
    /// when the memory has huge pages (2 MiB is the smallest huge page size).
    const HUGE: usize = 2 << 20;

    /// The system's page size (4 KiB on x86-64; 16 or 64 KiB on some
    /// aarch64 kernels).
    pub(super) fn page_size() -> usize {
        // SAFETY: sysconf has no preconditions.
        usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1)
    }

    /// The whole pages of `[ptr, ptr + bytes)`: `(start, end, page size)`.
    fn pages(ptr: usize, bytes: usize) -> (usize, usize, usize) {
        let page = page_size();
        (ptr.next_multiple_of(page), (ptr + bytes) / page * page, page)
    }

    /// Ranges of at most this many pages are probed whole, in one `mincore`
    /// call (2.1-2.8 us for 256-512 pages on the CI machine, against 1.5 us
    /// for one page); longer ones at three pages.
    pub(super) const SCAN_PAGES: usize = 512;

    /// Whether populating is supported and some page of `[start, end)` is not
    /// in memory: every page where there are at most [`SCAN_PAGES`], else the
    /// first, middle and last. False for an empty range.
    fn has_missing(start: usize, end: usize, page: usize) -> bool {
        if !SUPPORTED.load(Ordering::Relaxed) || end <= start {
            return false;
        }
        let n = (end - start) / page;
        if n <= SCAN_PAGES {
            let mut v = [0u8; SCAN_PAGES];
            // SAFETY: `[start, end)` is page-aligned and inside the caller's
            // slice; `v` has a byte for each of its `n` pages.
            let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, v.as_mut_ptr()) };
            // A failed query counts as "all there": nothing more is attempted.
            return rc == 0 && v[..n].iter().any(|b| b & 1 == 0);
        }
        [start, middle(start, end, page), end - page].into_iter().any(|p| !resident(p, page))
    }

    pub(super) fn fresh(ptr: *const u8, bytes: usize) -> bool {
        let (start, end, page) = pages(ptr as usize, bytes);
        if end > start && (end - start) / page > SCAN_PAGES {
            // Larger outputs are left to their blocks, each probing its own
            // pages: three probes of the whole could miss a part that is not
            // there yet, and a few probes per block cost nothing beside a
            // call that writes this much.
            return SUPPORTED.load(Ordering::Relaxed);
        }
        has_missing(start, end, page)
    }

    pub(super) fn populate(ptr: *mut u8, bytes: usize, top_first: bool) -> Pages {
        let (start, end, page) = pages(ptr as usize, bytes);
        if !has_missing(start, end, page) {
            // Too small, or already there (a reused buffer): populating pages
            // that exist costs a page-table walk each (about 80 ns per page,
            // measured) and saves nothing.
            return Pages::Present;
        }
        // Fault in one page, and see whether its neighbour came with it: then
        // the memory has huge pages, which already fault once per 2 MiB, and
        // zeroing them all ahead of the stores would only push the zeroed
        // lines out of cache (measured: 2-13% slower with huge pages). The
        // probe is a whole 2 MiB frame inside the range (only such a frame
        // can hold a huge page that no neighbouring slice has touched): the
        // bottom page of the first, or with `top_first` the top page of the
        // last, whose neighbour is then the page below it.
        let (lo, hi) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        let frame = if top_first { hi.checked_sub(HUGE) } else { Some(lo) };
        if let Some(frame) = frame.filter(|&f| f >= start && f + HUGE <= end) {
            let (probe, neighbour) =
                if top_first { (frame + HUGE - page, frame + HUGE - 2 * page) } else { (frame, frame + page) };
            if resident(neighbour, page) || (advise(probe, page) && resident(neighbour, page)) {
                return Pages::Huge;
            }
        }
        advise(start, end - start);
        Pages::Populated
    }

    /// `madvise(MADV_POPULATE_WRITE)` on `[at, at + len)`; false if refused.
    fn advise(at: usize, len: usize) -> bool {
        // SAFETY: every caller passes a page-aligned range inside the slice
        // given to `prefault`, which is mapped, writable and not aliased.
        // MADV_POPULATE_WRITE only faults pages in (existing pages keep their
        // contents, new ones are zero, as a first store would find them); it
        // reads and writes no byte itself.
        let rc = unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
        if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            SUPPORTED.store(false, Ordering::Relaxed);
        }
        rc == 0
    }

    /// The page-aligned address halfway through `[start, end)`.
    fn middle(start: usize, end: usize, page: usize) -> usize {
        start + (end - start) / page / 2 * page
    }

    /// Whether the page at `p` is in memory (a failed query counts as yes, so
    /// that nothing more is attempted).
    fn resident(p: usize, page: usize) -> bool {
        let mut v = 0u8;
        // SAFETY: `p` is a page-aligned address inside the caller's slice, and
        // `v` has room for the one page's byte.
        let rc = unsafe { libc::mincore(p as *mut libc::c_void, page, &mut v) };
        rc != 0 || v & 1 == 1
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub(super) fn fresh(_ptr: *const u8, _bytes: usize) -> bool {
        false
    }
    pub(super) fn populate(_ptr: *mut u8, _bytes: usize, _top_first: bool) -> super::Pages {
        super::Pages::Present
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_contents_and_neighbours_unchanged() {
        // Unaligned on both ends, large enough to be populated, and already
        // written: every byte must keep its value.
        let mut v: Vec<u8> = (0..(MIN_BYTES * 3 + 123)).map(|i| (i % 251) as u8).collect();
        let want = v.clone();
        prefault(&mut v[17..MIN_BYTES * 3 + 100], false);
        assert_eq!(v, want);
        // Fresh, never-written memory reads as zero afterwards.
        let mut z = vec![0f32; MIN_BYTES];
        prefault(&mut z, true);
        assert!(z.iter().all(|&x| x == 0.0));
        // Small and empty slices are no-ops.
        assert_eq!(prefault::<f64>(&mut [], true), Pages::Present);
        assert_eq!(prefault(&mut [1u8; 10], true), Pages::Present);
    }

    /// A private anonymous mapping of `.1` bytes at `.0`, unmapped on drop.
    #[cfg(target_os = "linux")]
    struct Mapping(*mut libc::c_void, usize);

    #[cfg(target_os = "linux")]
    impl Mapping {
        fn new(len: usize) -> Mapping {
            let (prot, flags) = (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS);
            // SAFETY: a new mapping, owned by the returned value.
            let base = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
            assert_ne!(base, libc::MAP_FAILED);
            Mapping(base, len)
        }
    }

    #[cfg(target_os = "linux")]
    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`; slices into it are dead by now.
            unsafe { libc::munmap(self.0, self.1) };
        }
    }

    /// Fresh anonymous memory has its pages in memory after the call, and
    /// reads as zero; pages outside the slice are not faulted in.
    #[cfg(target_os = "linux")]
    #[test]
    fn populates_fresh_memory() {
        let page = imp::page_size();
        let map = Mapping::new(64 * page);
        let base = map.0;
        let resident = |i: usize| {
            let mut v = 0u8;
            // SAFETY: page `i` lies inside the mapping.
            assert_eq!(unsafe { libc::mincore(base.cast::<u8>().add(i * page).cast(), page, &mut v) }, 0);
            v & 1 == 1
        };
        // SAFETY: pages 1..=62 plus a few bytes on each side, inside the mapping.
        let s = unsafe { std::slice::from_raw_parts_mut(base.cast::<u8>().add(page - 5), 62 * page + 10) };
        let found = prefault(s, false);
        assert_ne!(found, Pages::Present, "fresh memory reported present");
        let got: Vec<bool> = (0..64).map(resident).collect();
        let huge = got[0] || got[63];
        if !huge {
            // Pages 1..=62 lie wholly inside; 0 and 63 only in part.
            assert!(got[1..63].iter().all(|&r| r), "pages left out: {got:?}");
            assert!(!got[0] && !got[63], "a page partly outside the slice was faulted in: {got:?}");
            assert_eq!(found, Pages::Populated);
            // Every whole page is there now.
            assert_eq!(prefault(s, true), Pages::Present, "populated memory reported missing");
        }
        assert!(s.iter().all(|&b| b == 0));
    }

    /// With huge pages advised, the probe of a fresh range faults in one 2
    /// MiB frame, the last whole one inside the range with `top_first`, the
    /// first without, and says `Huge`; where the system gives 4 KiB pages
    /// instead, the range is populated whole.
    #[cfg(target_os = "linux")]
    #[test]
    fn probe_faults_the_frame_at_the_chosen_end() {
        let (page, huge) = (imp::page_size(), 2usize << 20);
        if page != 4096 {
            // With 16 or 64 KiB pages a transparent huge page is 32 or 512 MiB.
            eprintln!("skipped: {page}-byte pages, and this test knows the 2 MiB huge pages of 4 KiB ones");
            return;
        }
        for top_first in [false, true] {
            let map = Mapping::new(6 * huge);
            // SAFETY: the whole mapping, which this test owns.
            if unsafe { libc::madvise(map.0, map.1, libc::MADV_HUGEPAGE) } != 0 {
                eprintln!("skipped: MADV_HUGEPAGE refused");
                return;
            }
            let frame0 = (map.0 as usize + page).next_multiple_of(huge);
            // Two whole frames and a page on each side.
            let (from, to) = (frame0 - page, frame0 + 2 * huge + page);
            // SAFETY: `[from, to)` lies inside the mapping: `from` is at least its start, and
            // `to` at most 3 frames and 2 pages past it.
            let s = unsafe { std::slice::from_raw_parts_mut(from as *mut u8, to - from) };
            let found = prefault(s, top_first);
            let resident = |p: usize| {
                let mut v = 0u8;
                // SAFETY: `p` is a page inside the mapping.
                assert_eq!(unsafe { libc::mincore(p as *mut libc::c_void, page, &mut v) }, 0);
                v & 1 == 1
            };
            let (first, last) = (resident(frame0 + page), resident(frame0 + huge + page));
            if first && last {
                // 4 KiB pages (no THP here): the whole range was populated.
                assert_eq!(found, Pages::Populated);
                assert_eq!(prefault(s, top_first), Pages::Present);
                continue;
            }
            assert_eq!(found, Pages::Huge);
            assert_eq!((first, last), (!top_first, top_first), "top_first = {top_first}");
            assert!(s.iter().all(|&b| b == 0));
        }
    }

    /// `fresh` says yes while any whole page of a slice of up to
    /// `SCAN_PAGES` pages is missing, and no once every page is there; small
    /// slices never are; larger ones always are (their blocks decide).
    #[cfg(target_os = "linux")]
    #[test]
    fn fresh_finds_missing_pages() {
        let page = imp::page_size();
        for pages in [64usize, 500, 1200] {
            let map = Mapping::new((pages + 2) * page);
            // Madvised away from huge pages, so that touching one page does
            // not bring its neighbours (a refusal leaves the test as strict:
            // it then only sees fewer missing pages, and skips those cases).
            // SAFETY: the whole mapping, which this test owns.
            let no_huge = unsafe { libc::madvise(map.0, map.1, libc::MADV_NOHUGEPAGE) } == 0;
            // SAFETY: pages 1..=pages plus a few bytes on each side, inside the mapping.
            let s = unsafe { std::slice::from_raw_parts_mut(map.0.cast::<u8>().add(page - 5), pages * page + 10) };
            assert!(fresh(s), "{pages} fresh pages");
            if no_huge {
                // One page written in the middle: the others are still missing.
                s[5 + pages / 2 * page] = 1;
                assert!(fresh(s), "{pages} pages, one written");
            }
            s.fill(2);
            assert_eq!(fresh(s), pages > imp::SCAN_PAGES, "{pages} pages, all written");
            assert!(!fresh(&s[..MIN_BYTES - 1]), "below MIN_BYTES");
        }
        assert!(!fresh::<f32>(&[]));
    }

    /// A kernel writing into fresh memory (plain and, where the system
    /// allows, with huge pages advised) gives the same bytes as into a
    /// buffer already in use: prefaulting changes where faults happen, and
    /// the kernels that write fresh blocks from the top down
    /// ([`crate::rows::Order`]) the order of their stores, not what is
    /// written. The reference outputs go into memory written before, so
    /// they are stored in ascending order. On one thread each output is one
    /// block holding a whole 2 MiB frame, so the huge-page probe runs, and
    /// where it finds huge pages the bf16 kernels take the descending path,
    /// and rotary's tiles in every type (checked).
    #[cfg(target_os = "linux")]
    #[test]
    fn kernel_output_into_fresh_memory_is_unchanged() {
        use crate::rows::DESCENDED;
        use half::bf16;
        use std::sync::atomic::Ordering::Relaxed;
        // 4.4 MB of f32 and of bf16 (twice the rows).
        let (rows, cols) = (1100, 1000);
        let (n, nb) = (rows * cols, 2 * rows * cols);
        let input = |n: usize| (0..n).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0);
        let x: Vec<f32> = input(n).collect();
        let xb: Vec<bf16> = input(nb).map(bf16::from_f32).collect();
        let dyb: Vec<bf16> = xb[..nb / 2].iter().rev().copied().collect();
        // The gated forward's input: twice its output.
        let xg: Vec<bf16> = xb.iter().chain(&dyb).chain(&dyb).copied().collect();
        let w: Vec<f32> = (0..cols).map(|j| 0.5 + (j % 7) as f32 / 8.0).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        // Rotary on a q laid out [1, heads, seq, head_dim], passed
        // transposed (the tiled walk): 1100 x 10 heads of 100 (f32), 20 (bf16).
        let hd = 100;
        let shape = |heads| crate::rotary::Shape { batch: 1, seq: rows, heads, head_dim: hd, rotary_dim: hd };
        let strides = |n| crate::rotary::Strides { batch: n, seq: hd, heads: rows * hd };
        let angles: Vec<f32> = input(rows * hd / 2).collect();
        let angles_b: Vec<bf16> = angles.iter().map(|&v| bf16::from_f32(v)).collect();
        let (sin, sin_b): (Vec<f32>, Vec<bf16>) =
            (angles.iter().rev().copied().collect(), dyb[..rows * hd / 2].to_vec());
        // Each kernel, writing the whole of `out`, and where it writes
        // descending on huge pages.
        let kernels: [(&str, Descends, Kernel<f32>); 4] = [
            ("softmax", Descends::Never, &|out, par| crate::softmax::forward(&x, out, cols, 1.0, par).unwrap()),
            ("rms_norm", Descends::Never, &|out, par| {
                crate::rms_norm::forward(&x, Some(&w), out, cols, 1e-6, par).unwrap()
            }),
            ("layer_norm", Descends::Never, &|out, par| {
                crate::layer_norm::forward(&x, Some(&w), None, out, cols, 1e-5, par).unwrap()
            }),
            ("rotary_embedding (x.T)", Descends::Always, &|out, par| {
                crate::rotary::apply_strided(&x, strides(n), &angles, &sin, out, shape(10), false, false, par).unwrap()
            }),
        ];
        let silu = crate::gated::Activation::Silu;
        // Softmax writes upwards.
        let kernels_bf16: [(&str, Descends, Kernel<bf16>); 6] = [
            ("softmax bf16", Descends::Never, &|out, par| crate::softmax::forward(&xb, out, cols, 1.0, par).unwrap()),
            ("rms_norm bf16", Descends::Bf16, &|out, par| {
                crate::rms_norm::forward(&xb, Some(&wb), out, cols, 1e-6, par).unwrap()
            }),
            ("layer_norm bf16", Descends::Bf16, &|out, par| {
                crate::layer_norm::forward(&xb, Some(&wb), None, out, cols, 1e-5, par).unwrap()
            }),
            ("silu_and_mul bf16", Descends::Bf16, &|out, par| {
                crate::gated::forward(silu, &xg, out, cols, par).unwrap()
            }),
            ("silu_and_mul backward bf16", Descends::Bf16, &|out, par| {
                crate::gated::backward(silu, &dyb, &xb, out, cols / 2, par).unwrap()
            }),
            ("rotary_embedding (x.T) bf16", Descends::Always, &|out, par| {
                crate::rotary::apply_strided(&xb, strides(nb), &angles_b, &sin_b, out, shape(20), false, false, par)
                    .unwrap()
            }),
        ];
        let huge = huge_pages();
        // Where the kernels round bf16 in registers.
        let bf16_in_registers = crate::simd::has_v4_bf16();
        let check = |name: &str, descends: Descends, advice: Option<i32>, run: &dyn Fn()| {
            let before = DESCENDED.load(Relaxed);
            run();
            let descended = DESCENDED.load(Relaxed) > before;
            let expect = advice.is_some()
                && huge
                && match descends {
                    Descends::Never => false,
                    Descends::Bf16 => bf16_in_registers,
                    Descends::Always => true,
                };
            // Only this way: other tests' kernels may count while this one runs.
            assert!(descended || !expect, "{name}: no block went descending");
        };
        for advice in [None, Some(libc::MADV_HUGEPAGE)] {
            for (name, descends, k) in kernels {
                check(name, descends, advice, &|| same_into_fresh(name, n, advice, k));
            }
            for (name, descends, k) in kernels_bf16 {
                check(name, descends, advice, &|| same_into_fresh(name, nb, advice, k));
            }
        }
    }

    /// Where a kernel writes a block descending (on fresh huge pages).
    #[cfg(target_os = "linux")]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Descends {
        /// Never.
        Never,
        /// Where bf16 is rounded in registers (`rows::descends`).
        Bf16,
        /// In every type, on every CPU (`Split::get_descending_on_huge`).
        Always,
    }

    /// Whether this system gives huge pages where they are advised (a
    /// probe of a fresh advised range says so).
    #[cfg(target_os = "linux")]
    fn huge_pages() -> bool {
        let map = fresh_mapping(6 << 20, Some(libc::MADV_HUGEPAGE));
        // SAFETY: 4 MiB from the mapping's first 2 MiB boundary, inside it.
        let s = unsafe { std::slice::from_raw_parts_mut(map.aligned(0) as *mut u8, 4 << 20) };
        prefault(s, true) == Pages::Huge
    }

    /// A kernel writing into `n` values of fresh memory (with `advice`)
    /// gives the bits it gives into memory written before, on one thread
    /// and over rayon's pool.
    #[cfg(target_os = "linux")]
    fn same_into_fresh<T: crate::Element>(name: &str, n: usize, advice: Option<i32>, k: Kernel<T>) {
        use crate::par::Par;
        let mut want = vec![T::from_f64(f64::NAN); n];
        k(&mut want, Par::Seq);
        let size = std::mem::size_of::<T>();
        for par in [Par::Seq, Par::Rayon] {
            // Room for 4 MiB of alignment, so that a 2 MiB frame lies wholly inside.
            let map = fresh_mapping(n * size + (4 << 20), advice);
            // SAFETY: `n` values of `T` from 100 values past a 2 MiB boundary, inside the mapping.
            let out = unsafe { std::slice::from_raw_parts_mut(map.aligned(100 * size) as *mut T, n) };
            k(out, par);
            let bits = |v: &T| v.to_f64().to_bits();
            assert!(out.iter().zip(&want).all(|(a, b)| bits(a) == bits(b)), "{name} {advice:?} {par:?}");
        }
    }

    /// A kernel writing into the slice it is given, on the given threads.
    #[cfg(target_os = "linux")]
    type Kernel<'k, T> = &'k dyn Fn(&mut [T], crate::par::Par<'_>);

    /// A fresh mapping of `len` bytes with `advice` given (a refusal, where
    /// the system has no THP, changes nothing).
    #[cfg(target_os = "linux")]
    fn fresh_mapping(len: usize, advice: Option<i32>) -> Mapping {
        let map = Mapping::new(len);
        if let Some(a) = advice {
            // SAFETY: the whole mapping.
            unsafe { libc::madvise(map.0, len, a) };
        }
        map
    }

    #[cfg(target_os = "linux")]
    impl Mapping {
        /// The address `offset` bytes past the mapping's first 2 MiB boundary.
        fn aligned(&self, offset: usize) -> usize {
            (self.0 as usize).next_multiple_of(2 << 20) + offset
        }
    }
}
