//! Hostile-review probe (issue 19): `mem_location` sets the id that the level's own field reads back,
//! at whichever CUDA API level is compiled (run with the default features and with
//! `--no-default-features --features cuda-13020,dynamic-loading` / `cuda-13040`).

use cudarc::driver::sys::{CUmemLocation, CUmemLocationType};
use mempool::backend::cuda::mem_location;

#[allow(unreachable_code, clippy::needless_return)]
fn id_of(l: &CUmemLocation) -> i32 {
    #[cfg(any(feature = "cuda-13020", feature = "cuda-13030", feature = "cuda-13040"))]
    {
        // SAFETY: `id` is the union's int member, the one written.
        return unsafe { l.__bindgen_anon_1.id };
    }
    #[cfg(not(any(feature = "cuda-13020", feature = "cuda-13030", feature = "cuda-13040")))]
    {
        return l.id;
    }
}

#[test]
fn probe_mem_location_round_trips_at_this_level() {
    for (t, id) in [
        (CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 0),
        (CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 7),
        (CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, 3),
        (CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, -1),
        (CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, i32::MAX),
    ] {
        let l = mem_location(t, id);
        assert_eq!(l.type_, t);
        assert_eq!(id_of(&l), id);
    }
    assert_eq!(std::mem::size_of::<CUmemLocation>(), 8);
}
