//! Checks the CUDA feature choice before cudarc's bindings are compiled, where two API levels at
//! once end in hundreds of conflicting definitions instead of one clear sentence.

fn main() {
    let levels: Vec<String> = std::env::vars()
        .filter_map(|(k, _)| k.strip_prefix("CARGO_FEATURE_CUDA_").map(str::to_owned))
        .filter(|rest| rest.chars().all(|c| c.is_ascii_digit()) || rest == "VERSION_FROM_BUILD_SYSTEM")
        .map(|rest| format!("cuda-{}", rest.to_ascii_lowercase().replace('_', "-")))
        .collect();
    if levels.is_empty() {
        panic!(
            "cuda-mempool: choose a CUDA API level: one of the features cuda-12030 .. cuda-13040, or \
             cuda-version-from-build-system (the default features choose cuda-12080)"
        );
    }
    if levels.len() > 1 {
        panic!(
            "cuda-mempool: choose one CUDA API level, not {} ({}). The default features include \
             cuda-12080: to pick another, write `default-features = false, features = [\"cuda-XXXXX\", \
             \"dynamic-loading\"]`.",
            levels.len(),
            levels.join(", ")
        );
    }
    let links = ["DYNAMIC_LOADING", "DYNAMIC_LINKING", "STATIC_LINKING"]
        .iter()
        .filter(|f| std::env::var_os(format!("CARGO_FEATURE_{f}")).is_some())
        .count();
    if links != 1 {
        panic!(
            "cuda-mempool: choose exactly one of the features dynamic-loading (the default), dynamic-linking, \
             static-linking ({links} chosen)"
        );
    }
    println!("cargo:rerun-if-changed=build.rs");
}
