//! `tests/ui/pass/*.rs` must compile and run; each `tests/ui/fail/<macro>/<mistake>.rs` must fail
//! with exactly the error in its `.stderr` (regenerate with `TRYBUILD=overwrite`, then read the diff).
//! `tests/ui/fail/safety/` holds safe misuse of the allocator's unsafe contracts, which must not
//! compile either.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*/*.rs");
}
