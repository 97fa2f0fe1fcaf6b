#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bufcache_fuzz::nbd_addresses(data));
