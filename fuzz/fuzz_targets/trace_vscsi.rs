#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bufcache_fuzz::trace_vscsi(data));
