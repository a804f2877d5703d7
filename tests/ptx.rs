//! The embedded PTX (committed `ptx/`, or nvcc's output when build.rs found
//! one): one module per `kernels-cuda/*.cu`, each declaring at most the PTX ISA
//! of `kernels-cuda/ptx-isa.txt` for `compute_80`, so that drivers from CUDA
//! 12.0 on can JIT it. (`scripts/check-ptx.sh` assembles the committed files
//! with CUDA 12.0's ptxas; no GPU is needed for either check.)
use std::path::Path;

fn version(v: &str) -> (u32, u32) {
    let (major, minor) = v.trim().split_once('.').expect("a version such as 8.0");
    (major.parse().expect("major"), minor.parse().expect("minor"))
}

#[test]
fn every_source_has_a_module() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels-cuda");
    let mut sources: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".cu").map(String::from))
        .collect();
    sources.sort();
    let mut modules: Vec<String> = keel::ptx::ALL.iter().map(|(name, _)| name.to_string()).collect();
    modules.sort();
    assert_eq!(sources, modules);
}

#[test]
fn modules_declare_at_most_the_pinned_isa_for_sm_80() {
    let isa = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels-cuda/ptx-isa.txt")).unwrap();
    assert_eq!(keel::ptx::ISA, isa.trim());
    for (name, ptx) in keel::ptx::ALL {
        let directive =
            |d: &str| ptx.lines().find_map(|l| l.strip_prefix(d)).unwrap_or_else(|| panic!("{name}: no {d}"));
        let declared = directive(".version ");
        assert!(
            version(declared) <= version(keel::ptx::ISA),
            "{name}.ptx declares ISA {declared}, newer than {} (origin: {})",
            keel::ptx::ISA,
            keel::ptx::ORIGIN
        );
        assert_eq!(directive(".target ").trim(), "sm_80", "{name}");
        assert!(ptx.contains(".entry "), "{name}: no kernels");
    }
}
