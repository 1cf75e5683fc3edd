//! Pools shared by the KV integration tests (`mod common;` in each test file).

use std::sync::Arc;

use pdd_io::pool::{MemoryRegion, PagePool};

/// `layers` x `pages` pages of `page` bytes, each byte a function of its offset (in
/// steps of `step` bytes), the layer and `seed`: any byte out of place shows.
pub fn pattern_pool(layers: u16, pages: u32, page: u32, seed: u8, step: u32) -> Arc<PagePool> {
    let regions = (0..layers)
        .map(|l| {
            let bytes: Vec<u8> = (0..pages * page)
                .map(|i| {
                    ((i / step) as u8)
                        .wrapping_mul(31)
                        .wrapping_add(seed)
                        .wrapping_add(l as u8 * 7)
                })
                .collect();
            MemoryRegion::from_vec(bytes)
        })
        .collect();
    Arc::new(PagePool::new(regions, page).unwrap())
}

/// The same geometry, all zeros (a receiver's pool).
pub fn zero_pool(layers: u16, pages: u32, page: u32) -> Arc<PagePool> {
    let regions = (0..layers)
        .map(|_| MemoryRegion::from_vec(vec![0; (pages * page) as usize]))
        .collect();
    Arc::new(PagePool::new(regions, page).unwrap())
}
